"""The ranks of a node get a file's token cache together: local rank 0 builds it with the node's
other ranks as helpers (``team``: they tokenize their share of the chunks, rank 0 commits),
coordinated through files, never inside a collective."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from ..formats import DataError
from .build import BuildInterrupted, build_or_reuse, interrupts_raise
from .chunks import default_num_proc, encode_here, iter_chunks, start_pool, stop_encoding
from .team import AHEAD_CHUNKS, POLL_S, Team, remove_stale_teams

WAIT_REPORT_S = 30.0  # how often a waiting rank prints that it is still waiting
WAIT_POLL_S = 0.2


def build_or_reuse_on_node(
    path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error", num_proc: int | None = None
) -> Path:
    """``build_or_reuse`` on this process, or on each node's team under ``torch.distributed``.

    ``num_proc``: tokenizer processes of the node (default: every core); a node's local ranks
    share them. The build holds no collective (NCCL's watchdog would kill the waiting ranks after
    the process group's timeout): the ranks agree on a nonce and learn which of them share a node
    first (quick: nobody builds yet); then local rank 0 builds with the node's other ranks as
    helpers and writes its outcome (cache path or error) to a status file named by the nonce;
    the helpers tokenize their chunks while the lead builds, then poll for that file, printing a
    line every ``WAIT_REPORT_S`` seconds. Only then, with everybody done, the ranks gather the
    outcomes, so if any builder failed all ranks raise the same ``DataError``. With NCCL, set the
    CUDA device before (the object collectives need it).
    """
    num_proc = num_proc or default_num_proc()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)

    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    node = rank - local_rank
    nonce = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(nonce)  # quick: nobody is building yet
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, (socket.gethostname(), node, local_rank))
    local = sorted(place[2] for place in places if place[:2] == (socket.gethostname(), node))
    team = Team(cache_root, nonce[0], node, len(local), local.index(local_rank)) if len(local) > 1 else None
    workers = max(1, num_proc // len(local))  # the node's cores, shared by its ranks
    status_file = Path(cache_root) / f".build-{nonce[0]}-rank{node}.json"
    interrupted = None
    if local_rank == 0:
        try:
            remove_stale_teams(cache_root)
            result = (None, str(build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, workers, team)))
        except BuildInterrupted as exc:
            interrupted, result = exc, (f"rank {rank}: {exc}", None)
        except DataError as exc:
            result = (str(exc), None)
        except Exception as exc:  # noqa: BLE001 - must reach the other ranks, not hang them
            result = (f"building the token cache failed on rank {rank}: {type(exc).__name__}: {exc}", None)
        _write_status(status_file, result)
    else:
        with interrupts_raise():
            result = _help_and_wait(status_file, rank, team, path, tokenizer, workers)
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


def _help_and_wait(status_file: Path, rank: int, team: Team | None, path: Path, tokenizer, workers: int) -> tuple:
    """A helper: tokenize this rank's chunks once the lead publishes its plan, and wait for the
    lead's outcome."""
    start = last_report = time.monotonic()
    if team is not None:
        team.join()
    helped = team is None or not team.joined  # a rank that could not join only waits
    try:
        while not status_file.is_file():
            plan = team.plan() if not helped else None
            if plan is not None:
                helped = True
                try:
                    _help(team, plan, path, tokenizer, workers)
                except BuildInterrupted:
                    raise
                except Exception as exc:  # noqa: BLE001 - the lead tokenizes what this rank does not
                    print(f"rank {rank}: helping to build the token cache failed ({type(exc).__name__}: {exc}); "
                          "local rank 0 tokenizes this rank's chunks", file=sys.stderr, flush=True)
                    team.leave()
                continue
            time.sleep(WAIT_POLL_S)
            now = time.monotonic()
            if now - last_report >= WAIT_REPORT_S:
                last_report = now
                print(f"rank {rank}: waiting for local rank 0 to build the token cache ({now - start:.0f} s)", flush=True)
    finally:
        if team is not None:
            team.leave()
            if status_file.is_file():  # the lead is done: nothing of the team is needed (no build: no plan either)
                shutil.rmtree(team.dir, ignore_errors=True)
    return tuple(json.loads(status_file.read_text(encoding="utf-8")))


def _help(team: Team, plan: dict, path: Path, tokenizer, workers: int) -> None:
    """Tokenize this member's chunks of the plan (chunk ``c`` is member ``c % size``'s) into the
    team directory, in order, never more than ``AHEAD_CHUNKS`` waiting for the lead; stop when the
    lead is done or gone. The build's errors are the lead's to report: a helper only stops."""
    size, member = plan["size"], team.member
    chunks = iter_chunks(path, plan["max_seq_len"], plan["start_row"], plan["chunk_lines"])
    mine = (task for number, task in enumerate(chunks) if number % size == member)
    pool = start_pool(tokenizer, workers)
    try:
        results = pool.imap(_throttled(mine, team)) if pool else map(encode_here, mine)
        for number, result in zip(range(member, sys.maxsize, size), results):
            while team.waiting() >= AHEAD_CHUNKS and _lead_working(team):
                time.sleep(POLL_S)
            if not _lead_working(team):
                return
            team.put(number, result)
    except OSError:  # the lead removed the team directory (it is done): nothing left to help with
        return
    finally:
        stop_encoding(pool)


def _lead_working(team: Team) -> bool:
    return team.plan() is not None and team.alive(0)


def _throttled(tasks, team: Team):
    """The pool's tasks, handed out only while this helper has room for their results."""
    for task in tasks:
        while team.waiting() >= AHEAD_CHUNKS and _lead_working(team):
            time.sleep(POLL_S)
        if not _lead_working(team):
            return
        yield task
