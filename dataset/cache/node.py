"""The ranks of a node get a file's token cache: local rank 0 builds it with every core of the node
(the CPUs of all the node's ranks: under SLURM's ``--cpus-per-task`` each rank is bound to its own),
the other ranks wait for it.

No collective is held while building (NCCL's watchdog would kill the waiting ranks after the
process group's timeout): the ranks agree on a nonce and learn who shares a node and its cores
first (quick: nobody builds yet); local rank 0 builds and sets its outcome (cache path or error)
in the process group's store under a key named by the nonce, never on the filesystem (a cache
folder that cannot be written must still reach the others); the others poll for that key, saying
so once local rank 0 has taken ``waiting.WAIT_FIRST_S`` seconds (longer than reusing a cache
takes), then every ``waiting.WAIT_REPORT_S``. Then each rank sets its own key and polls until
every node is done (no collective waits on a build), so if any build failed all ranks raise the
same error: a ``DataError``, or the ``OSError`` of a cache folder that cannot be written (the
trainer turns it into a line that names ``--cache_dir``). With NCCL, set the CUDA device before
(the object collectives need it).

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
    path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error", num_proc: int | None = None,
    *, local_rank: int,
) -> Path:
    """``build.build_or_reuse`` on this process, or on local rank 0 of each node under
    ``torch.distributed`` (module docstring). ``num_proc``: tokenizer processes (default: one per
    core of the node). ``local_rank``: this process's rank on its node, as its launcher gives it
    (``LOCAL_RANK``, ``--local_rank`` or ``SLURM_LOCALID``: the trainer's ``launch_env``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)

    rank = dist.get_rank()
    node = rank - local_rank
    nonce = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(nonce)  # quick: nobody is building yet
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, (socket.gethostname(), node, sorted(usable_cores())))
    cores = {core for host, its_node, its_cores in places if (host, its_node) == (socket.gethostname(), node)
             for core in its_cores}
    store = dist.distributed_c10d._get_default_store()
    keys = [f"minisft/cache-build-{nonce[0]}/rank{other}" for other in range(dist.get_world_size())]
    failure = None  # what this rank's own build raised, re-raised with its traceback
    if local_rank == 0:
        try:
            built = build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc or len(cores), cores)
            outcome = (None, str(built), None)
        except BuildInterrupted as exc:
            failure, outcome = exc, (f"rank {rank}: {exc}", None, None)
        except DataError as exc:
            outcome = (str(exc), None, None)
        except OSError as exc:  # a cache folder that cannot be written: the trainer names --cache_dir
            failure, outcome = exc, (f"rank {rank}: {exc}", None, [exc.errno, exc.strerror, exc.filename])
        except Exception as exc:  # noqa: BLE001 - must reach the other ranks, not hang them
            outcome = (f"building the token cache failed on rank {rank}: {type(exc).__name__}: {exc}", None, None)
    else:
        with interrupts_raise():
            outcome = wait_for_local_build(store, keys[node], rank, path)
    outcomes = _gather_when_every_node_is_done(store, keys, rank, outcome)
    if isinstance(failure, BuildInterrupted):
        raise failure
    failed = next((other for other in outcomes if other[0] is not None), None)
    if failed is None:
        return Path(outcome[1])
    if failure is not None and failed == outcome:
        raise failure
    if failed[2] is not None:
        raise OSError(*failed[2])  # every rank alike, as the rank that met it
    raise DataError(failed[0])  # every rank alike: the training script prints it once


def _gather_when_every_node_is_done(store, keys: list[str], rank: int, outcome: tuple) -> list[tuple]:
    """Every rank's outcome, through the process group's store rather than a collective: a node
    that builds longer than the others (a slower disk, a new machine joining a resumed run) would
    otherwise make their ranks meet the collective timeout (--dist_timeout) while they wait. Each
    rank sets its own key (local rank 0's is what the node's other ranks wait for), then polls
    until every rank's key is there, saying so (``waiting.poll``)."""
    store.set(keys[rank], json.dumps(outcome))
    with interrupts_raise():
        waiting.poll(lambda: store.check(keys), f"rank {rank}: waiting for the other nodes to build the token cache")
    return [_read_outcome(store, key) for key in keys]


def _read_outcome(store, key: str) -> tuple:
    """A rank's outcome: (error line or None, cache path or None, [errno, strerror, filename] of an OSError or None)."""
    return tuple(json.loads(store.get(key)))


def wait_for_local_build(store, key: str, rank: int, path: Path) -> tuple:
    """Local rank 0's outcome, once its key is in the store."""
    waiting.poll(lambda: store.check([key]),
                 f"rank {rank}: waiting for local rank 0 to build the token cache of {Path(path).name}")
    return _read_outcome(store, key)
