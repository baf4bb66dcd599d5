"""The process groups a run opens beside the default one, and the teardown of them all.

Beside the default group, gloo groups of every process, by what they carry:
- "host": the loop's per-step figures (host values: token counts, the stop flag) beside an NCCL
  group, so that agreeing on them never makes a rank wait for its GPU;
- "checkpoint": the collectives of a background sharded write (trainer/checkpoint/sharded.py),
  apart from the group the training loop uses meanwhile.

Each is made once under the default group it belongs to. `close_process_groups` destroys them all
and drops every reference that would keep one alive: a gloo group held on to keeps its worker
threads running into the interpreter's exit, where tearing them down can abort a finished run."""

import datetime
import gc
import sys

import torch.distributed as dist

_SIDE_GROUPS: dict[str, tuple] = {}  # purpose -> (the default group it was made under, the group)


def side_group(purpose: str, timeout: datetime.timedelta | None = None):
    """The gloo group of every process for `purpose`, made the first time it is asked for under the
    current default group (then collective: every rank asks)."""
    held = _SIDE_GROUPS.get(purpose)
    if held is None or held[0] is not dist.group.WORLD:
        options = {} if timeout is None else {"timeout": timeout}
        held = _SIDE_GROUPS[purpose] = (dist.group.WORLD, dist.new_group(backend="gloo", **options))
    return held[1]


def open_host_group(backend: str, timeout: datetime.timedelta) -> None:
    """Beside an NCCL group, a gloo group of the same processes (collective: every rank calls it)."""
    if backend != "gloo":
        side_group("host", timeout)


def host_group():
    """The group for host values: the "host" group, or None (the default group, which is gloo
    already, or there is only one process)."""
    held = _SIDE_GROUPS.get("host")
    return held[1] if held is not None and held[0] is dist.group.WORLD else None


def close_process_groups() -> None:
    """Destroy every process group, and drop what would keep one alive after that: this module's
    references, and FSDP2's device mesh (`release_device_meshes`). Without a process group (one
    process) there is nothing to drop."""
    _SIDE_GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        release_device_meshes()


def release_device_meshes() -> None:
    """Drop the process groups of every device mesh still alive: torch's DTensor caches keep FSDP2's
    mesh (their entries hold the mesh their layouts were made on), and a mesh holds its groups by
    name in `_pg_registry` (torch 2.11 to 2.13). The groups are destroyed already; the mesh is of no
    use after them. A mesh in uncollected garbage is listed too, and let go of the same way."""
    if "torch.distributed.device_mesh" not in sys.modules:
        return
    from torch.distributed.device_mesh import DeviceMesh
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()
