"""The ranks of a node get a file's token cache: local rank 0 builds it with every core of the node
(the CPUs of all the node's ranks: under SLURM's ``--cpus-per-task`` each rank is bound to its own),
the other ranks wait for it on the filesystem.

No collective is held while building (NCCL's watchdog would kill the waiting ranks after the
process group's timeout): the ranks agree on a nonce and learn who shares a node and its cores
first (quick: nobody builds yet); local rank 0 builds and writes its outcome (cache path or error)
to a status file named by the nonce; the others poll for that file, saying so once local rank 0
has taken ``waiting.WAIT_FIRST_S`` seconds (longer than reusing a cache takes), then every
``waiting.WAIT_REPORT_S``. Then the ranks share the outcomes through the store, each polling until
every node is done (no collective waits on a build), so if any build failed all ranks raise the
same ``DataError``. With NCCL, set the CUDA device before (the object collectives need it).

Local rank 0 alone was measured against the node's ranks tokenizing a share of the chunks each
(2 and 4 ranks, bound to their own cores or not): it built as fast or faster (docs/token_cache.md).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from ..formats import DataError
from . import waiting
from .build import BuildInterrupted, build_or_reuse, interrupts_raise
from .workers import usable_cores


def build_or_reuse_on_node(
    path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error", num_proc: int | None = None
) -> Path:
    """``build.build_or_reuse`` on this process, or on local rank 0 of each node under
    ``torch.distributed`` (module docstring). ``num_proc``: tokenizer processes (default: one per
    core of the node)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)

    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    node = rank - local_rank
    nonce = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(nonce)  # quick: nobody is building yet
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, (socket.gethostname(), node, sorted(usable_cores())))
    cores = {core for host, its_node, its_cores in places if (host, its_node) == (socket.gethostname(), node)
             for core in its_cores}
    status_file = Path(cache_root) / f".build-{nonce[0]}-rank{node}.json"
    interrupted = None
    if local_rank == 0:
        try:
            built = build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc or len(cores), cores)
            result = (None, str(built))
        except BuildInterrupted as exc:
            interrupted, result = exc, (f"rank {rank}: {exc}", None)
        except DataError as exc:
            result = (str(exc), None)
        except Exception as exc:  # noqa: BLE001 - must reach the other ranks, not hang them
            result = (f"building the token cache failed on rank {rank}: {type(exc).__name__}: {exc}", None)
        _write_status(status_file, result)
    else:
        with interrupts_raise():
            result = wait_for_local_build(status_file, rank, path)
    results = _gather_when_every_node_is_done(result, nonce[0], rank, dist.get_world_size())
    if local_rank == 0:
        status_file.unlink(missing_ok=True)
    errors = [error for error, _ in results if error is not None]
    if interrupted is not None:
        raise interrupted
    if errors:
        raise DataError(errors[0])  # every rank alike: the training script prints it once
    return Path(result[1])


def _gather_when_every_node_is_done(result: tuple, nonce: str, rank: int, world_size: int) -> list:
    """Every rank's outcome, through the process group's store rather than a collective: a node
    that builds longer than the others (a slower disk, a new machine joining a resumed run) would
    otherwise make their ranks meet the collective timeout (--dist_timeout) while they wait. Each
    rank sets its own key, then polls until every rank's key is there, saying so (``waiting.poll``)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    keys = [f"minisft/cache-build-{nonce}/rank{other}" for other in range(world_size)]
    store.set(keys[rank], json.dumps(result))
    with interrupts_raise():
        waiting.poll(lambda: store.check(keys), f"rank {rank}: waiting for the other nodes to build the token cache")
    return [tuple(json.loads(store.get(key))) for key in keys]


def _write_status(status_file: Path, result: tuple) -> None:
    status_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = status_file.with_name(status_file.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, status_file)


def wait_for_local_build(status_file: Path, rank: int, path: Path) -> tuple:
    """Local rank 0's outcome, once its status file is there."""
    waiting.poll(status_file.is_file,
                 f"rank {rank}: waiting for local rank 0 to build the token cache of {Path(path).name}")
    return tuple(json.loads(status_file.read_text(encoding="utf-8")))

