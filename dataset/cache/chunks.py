"""What one build worker does: a chunk of the data file's lines -> their tokens and loss masks.

The file is read in chunks of lines (``build.CHUNK_LINES``); each chunk is parsed (``formats``) and
encoded through the one seam from a conversation to its tokens (``dataset.tokens``), in a worker
process of ``workers.WorkerPool`` (or in this process when the build has one core).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..formats import LineError, parse_line
from ..sources import open_lines
from ..tokens import encode_conversations, uses_chatml_encoder
from .workers import WorkerPool

_worker_tokenizer = None  # the tokenizer of this worker process (set by ``start_pool`` or ``encode_here``)


def usable_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity: a job's share of the machine)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return set(range(os.cpu_count() or 1))


def default_num_proc() -> int:
    """One tokenizer process per core this process may run on."""
    return max(1, len(usable_cores()))


def iter_chunks(path: Path, max_seq_len: int, start_row: int, chunk_lines: int) -> Iterator[tuple[int, list[bytes], int]]:
    """Tasks ``(first line number, lines, max_seq_len)`` of ``chunk_lines`` lines, from the line
    after the first ``start_row`` ones (read past, not parsed)."""
    lines: list[bytes] = []
    first_line = 1
    for number, line in enumerate(itertools.islice(open_lines(path), start_row, None), start=start_row + 1):
        if not lines:
            first_line = number
        lines.append(line)
        if len(lines) == chunk_lines:
            yield first_line, lines, max_seq_len
            lines = []
    if lines:
        yield first_line, lines, max_seq_len


def count_lines(path: Path) -> int:
    return sum(1 for _ in open_lines(path))


def encode_chunk(task: tuple[int, list[bytes], int], encode: Callable) -> dict:
    """Parse and encode one chunk of lines (``first_line`` is the 1-based number of ``lines[0]``);
    ``encode(conversations, max_seq_len)`` gives each one's (ids, mask) or its ``LineError``."""
    first_line, lines, max_seq_len = task
    numbers, conversations, bad = [], [], []
    for line_number, raw_line in enumerate(lines, start=first_line):
        if not raw_line.strip():
            continue
        try:
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LineError(f"invalid UTF-8 at byte {exc.start}") from None
            conversations.append(parse_line(line))
            numbers.append(line_number)
        except LineError as exc:
            bad.append((line_number, str(exc)))
    ids_parts, mask_parts, lengths = [], [], []
    dropped = 0
    for line_number, result in zip(numbers, encode(conversations, max_seq_len)):
        if isinstance(result, LineError):
            bad.append((line_number, str(result)))
            continue
        ids, mask = result
        if not mask.any():
            dropped += 1
            continue
        ids_parts.append(ids)
        mask_parts.append(mask)
        lengths.append(len(ids))
    bad.sort()
    return {
        "ids": np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64),
        "mask": np.concatenate(mask_parts) if mask_parts else np.zeros(0, dtype=bool),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "bad": bad,
        "dropped": dropped,
        "rows": len(lines),
    }


def _encode_with_worker_tokenizer(conversations, max_seq_len: int) -> list:
    return encode_conversations(_worker_tokenizer, conversations, max_seq_len)


def encode_here(task: tuple[int, list[bytes], int]) -> dict:
    """``encode_chunk`` with the tokenizer of this process (a worker's, or the builder's)."""
    return encode_chunk(task, _encode_with_worker_tokenizer)


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _init_pool_worker(tokenizer, cores: set[int] | None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker per core: no tokenizer threads on top
    if cores:
        with contextlib.suppress(OSError):  # cores outside this job's CPU set: the ones it has
            os.sched_setaffinity(0, cores)
    _init_worker(tokenizer)


def start_pool(tokenizer, num_workers: int, cores: set[int] | None = None) -> WorkerPool | None:
    """A pool of ``num_workers`` processes running ``encode_here`` (None for one: this process
    tokenizes, with ``encode_here`` too), allowed on ``cores`` (default: this process's);
    ``stop_encoding`` when done."""
    if num_workers <= 1:
        _init_worker(tokenizer)
        return None
    uses_chatml_encoder(tokenizer)  # decided once here: the forked workers inherit it
    return WorkerPool(encode_here, num_workers, _init_pool_worker, (tokenizer, cores), what="the token cache build")


def stop_encoding(pool: WorkerPool | None) -> None:
    """End the pool (if any) and forget this process's tokenizer."""
    _init_worker(None)
    if pool is not None:
        pool.close()
