"""How the processes of a run get a file's token cache: built by local rank 0 of each node while the
other ranks of the node wait on the filesystem, never inside a collective."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .formats import DataError
from .token_cache import BuildInterrupted, interrupts_raise, build_or_reuse, default_num_proc


WAIT_REPORT_S = 30.0  # how often a waiting rank prints that it is still waiting
WAIT_POLL_S = 0.2


def prepare_cache(
    path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error", num_proc: int | None = None
) -> Path:
    """``build_or_reuse`` on this process, or on local rank 0 only under ``torch.distributed``.

    The build holds no collective (NCCL's watchdog would kill the waiting ranks after the
    process group's timeout): local rank 0 writes its outcome (cache path or error) to a status
    file named by a nonce the ranks agree on first; the other ranks of its node poll for that
    file, printing a line every ``WAIT_REPORT_S`` seconds. Only then, with everybody done, the
    ranks gather the outcomes, so if any builder failed all ranks raise the same ``DataError``.
    With NCCL, set the CUDA device before (the object collectives need it).
    """
    num_proc = num_proc or default_num_proc()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)

    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    nonce = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(nonce)  # quick: nobody is building yet
    status_file = Path(cache_root) / f".build-{nonce[0]}-rank{rank - local_rank}.json"
    interrupted = None
    if local_rank == 0:
        try:
            result = (None, str(build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)))
        except BuildInterrupted as exc:
            interrupted, result = exc, (f"rank {rank}: {exc}", None)
        except DataError as exc:
            result = (str(exc), None)
        except Exception as exc:  # noqa: BLE001 - must reach the other ranks, not hang them
            result = (f"building the token cache failed on rank {rank}: {type(exc).__name__}: {exc}", None)
        _write_status(status_file, result)
    else:
        with interrupts_raise():
            result = _wait_for_status(status_file, rank)
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)  # everybody has finished waiting: this is quick
    if local_rank == 0:
        status_file.unlink(missing_ok=True)
    errors = [error for error, _ in results if error is not None]
    if interrupted is not None:
        raise interrupted
    if errors:
        raise DataError(errors[0])
    return Path(result[1])


def _write_status(status_file: Path, result: tuple) -> None:
    status_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = status_file.with_name(status_file.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, status_file)


def _wait_for_status(status_file: Path, rank: int) -> tuple:
    start = last_report = time.monotonic()
    while not status_file.is_file():
        time.sleep(WAIT_POLL_S)
        now = time.monotonic()
        if now - last_report >= WAIT_REPORT_S:
            last_report = now
            print(f"rank {rank}: waiting for local rank 0 to build the token cache ({now - start:.0f} s)", flush=True)
    return tuple(json.loads(status_file.read_text(encoding="utf-8")))
