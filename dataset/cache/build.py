"""Build a file's token cache, or reuse the finished one: a jsonl (or .jsonl.gz or .parquet, read by
``sources``) file tokenized once into memory-mapped files.

Layout of ``<cache_root>/<key>/``:

* ``tokens.bin``    flat token ids, smallest unsigned dtype that fits the vocab (uint16 for 6400)
* ``loss_mask.bin`` flat uint8, 1 where the token carries loss
* ``offsets.npy``   int64 (n + 1,), sample ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``
* ``meta.json``     counts (samples, tokens, skipped bad lines, dropped samples), the dtype and
                    ``samples_digest`` (which samples it holds: ``resumable.chain_samples``)

``key`` (``key.cache_key``) hashes the data file's bytes, the tokenizer fingerprint (vocab,
merges, special tokens, chat template), ``max_seq_len``, ``CACHE_VERSION`` (the layout),
``TOKENS_VERSION`` (the code that turns a row into tokens and labels) and ``ROWS_VERSION`` (the rules
that decide which rows are bad); ``meta.json`` records ``tokens_version`` and ``rows_version``, and a
cache that records others is built again. The file is read in chunks
of ``CHUNK_LINES`` lines; each chunk is parsed (``formats``) and encoded through the one seam from
a conversation to its tokens (``dataset.tokens``) by ``encode_chunk``, in the worker processes of
``workers.WorkerPool`` (or in this process when the build has one core), and appended to a
resumable build (``resumable``): a killed build keeps the rows it committed and the next build of
the same key continues after them; the finished cache is renamed into place, so a reader never
sees a half-written cache. Before a finished cache is reused its files are checked
(``finished.read_checked``): a damaged one is built again. ``open_finished`` opens the finished
cache (``finished.TokenCache``, which checks its files once) and builds nothing.

SIGTERM or SIGINT during a build raise ``BuildInterrupted`` (the workers are killed; the finished
rows are kept for the next run).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..formats import DataError, LineError, decode_line, parse_line
from ..printable import print_escaped
from ..rendering import token_dtype
from ..sources import check_data_file, open_lines
from ..tokens import encode_conversations, uses_chatml_encoder
from .finished import TokenCache, read_checked, read_meta
from .key import (
    CACHE_VERSION, ROWS_CHANGES, ROWS_VERSION, TOKENS_CHANGES, TOKENS_VERSION, UNRECORDED_ROWS_VERSION, cache_key,
    data_digest, older_keys,
)
from .resumable import PartialBuild, Progress, remove_stale_partials
from .workers import STOP_SIGNALS, WorkerPool, default_num_proc

CHUNK_LINES = 512  # lines per task of a worker
PROGRESS_S = 10.0  # seconds between progress lines while building
BAD_DATA_MODES = ("error", "skip")


class BuildInterrupted(Exception):
    """SIGTERM or SIGINT arrived while the cache was being built; the build stopped and cleaned up."""

    def __init__(self, signum: int):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"{name} while building the token cache: stopped; run the same command again to continue it "
                         "(the rows tokenized so far are kept)")


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """While building, SIGTERM/SIGINT raise ``BuildInterrupted`` in this (main) thread.

    The trainer's own SIGTERM handler only sets a "stop at the next step" flag, which nothing
    reads while tokenizing: the pool workers die of the group's SIGTERM, the pool replaces
    them and the parent would wait forever for their lost chunks.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise BuildInterrupted(signum)

    previous = {signum: signal.signal(signum, _raise) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ----------------------------------------------------------------------------- building


class BuildProgress:
    """One line to stderr every ``PROGRESS_S`` seconds while building: rows done, rows/s, ETA."""

    def __init__(self, path: Path, total_rows: int, start_row: int = 0):
        self.path, self.total = path, total_rows
        self.done = self.start_row = start_row  # rows of an earlier, interrupted build count as done, not in the rate
        self.start = self.last = time.monotonic()

    def advance(self, rows: int) -> None:
        self.done += rows
        now = time.monotonic()
        if now - self.last >= PROGRESS_S or self.done == self.total:
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            rate = (self.done - self.start_row) / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print_escaped(f"tokenizing {self.path.name}: {self.done:,}/{self.total:,} rows "
                          f"({100 * self.done / max(self.total, 1):.0f}%), {rate:,.0f} rows/s, elapsed {elapsed:.0f} s, "
                          f"ETA {eta:.0f} s", file=sys.stderr)


def build_cache(path: Path, tokenizer, max_seq_len: int, target: Path, bad_data: str, num_proc: int,
                cores: set[int] | None = None) -> None:
    """Tokenize ``path`` into the cache directory ``target``, continuing a killed build of it.

    The rows go through ``resumable.PartialBuild`` (``<cache_root>/.partial-<key>/``): what
    was committed there by an earlier, interrupted build of the same key is kept and the build
    continues at its next row; the finished cache is moved into place at the end. With
    ``bad_data="error"`` the first bad line raises ``DataError``; with ``"skip"`` bad lines are
    counted and the first one is recorded in ``meta.json``. SIGTERM or SIGINT raise
    ``BuildInterrupted`` after ending the pool; the finished rows stay for the next run. ``cores``:
    where the ``num_proc`` tokenizer processes may run (default: where this process may).
    """
    target.parent.mkdir(parents=True, exist_ok=True)  # its OSError names the folder (e.g. a file in the way)
    digest = data_digest(path, target.parent)
    partial = PartialBuild(target, token_dtype(len(tokenizer)))
    pool = None
    stopped = None
    try:
        with interrupts_raise():
            if not partial.claim():
                return  # another process finished it while we waited
            data_file = str(path.resolve())  # one name for the file however it is given
            remove_stale_partials(target.parent, data_file, digest)
            done = partial.resume(target.name, data_file, digest, lambda: count_lines(path))
            total_rows, start_row = done.total_rows, done.rows
            if 0 < start_row < total_rows:  # with every row done, the build's outcome says all there is
                print_escaped(restart_line(path, data_file, partial.earlier), file=sys.stderr)
            chunks = iter_chunks(path, max_seq_len, start_row, CHUNK_LINES)
            remaining = -(-(total_rows - start_row) // CHUNK_LINES)
            pool = start_pool(tokenizer, min(num_proc, remaining), cores)
            results = pool.imap(chunks) if pool else map(encode_here, chunks)
            _write_cache(results, path, tokenizer, max_seq_len, partial, bad_data, BuildProgress(path, total_rows, start_row))
    except BaseException as exc:
        stopped = stop_reason(exc)
        raise
    finally:
        stop_encoding(pool)
        partial.release(stopped)


def stop_reason(exc: BaseException) -> str:
    """What ``progress.json`` records about a build that ``exc`` ended: the signal's name, or the
    error (one line)."""
    if isinstance(exc, BuildInterrupted):
        return signal.Signals(exc.signum).name
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    reason = text if isinstance(exc, DataError) else f"{type(exc).__name__}: {text}".rstrip(": ")
    return reason[:500]


def restart_line(path: Path, data_file: str, earlier: Progress) -> str:
    """The line a build that continues a committed partial build prints: "resuming" only after a
    real interruption (a signal, or a run killed before it could record how it ended), else
    "continuing" with the error that stopped the earlier run (a bad row in ``--bad_data error``
    mode, a full disk, a bug)."""
    where = f"{path.name}: the rows before were tokenized by an earlier run"
    if earlier.data_file != data_file:
        where += f" on {earlier.data_file} (the same bytes)"
    at = f"cache build at row {earlier.rows:,} of {earlier.total_rows:,}"
    if earlier.stopped is None:
        return f"resuming {at} ({where}, interrupted before it could record how: killed, or its machine lost)"
    if earlier.stopped in {s.name for s in STOP_SIGNALS}:
        return f"resuming {at} ({where}, interrupted by {earlier.stopped})"
    return f"continuing {at} ({where}, which stopped: {earlier.stopped})"


def _write_cache(results, path, tokenizer, max_seq_len, partial: PartialBuild, bad_data, progress) -> None:
    done = partial.progress
    if done.num_skipped and bad_data == "error":  # rows committed by an earlier run in "skip" mode
        raise DataError(done.first_bad_line)
    for result in results:
        bad = [f"{path}:{line_number}: {message}" for line_number, message in result["bad"]]
        if bad and bad_data == "error":
            raise DataError(bad[0])
        partial.append(result["ids"], result["mask"], result["lengths"], result["rows"], bad, result["dropped"])
        progress.advance(result["rows"])
    if done.samples == 0:
        raise DataError(
            f"{path}: no usable samples ({done.num_skipped} bad lines skipped, {done.num_dropped} samples without "
            f"loss tokens after truncation to max_seq_len={max_seq_len})"
        )
    partial.finish({
        "version": CACHE_VERSION,
        "tokens_version": TOKENS_VERSION,
        "rows_version": ROWS_VERSION,
        "data_file": str(path),
        "data_digest": partial.progress.data_digest,
        "max_seq_len": max_seq_len,
        "vocab_size": len(tokenizer),
        "dtype": partial.dtype.name,
        "num_samples": done.samples,
        "samples_digest": done.samples_digest,
        "num_tokens": done.tokens,
        "num_skipped": done.num_skipped,
        "first_bad_line": done.first_bad_line,
        "num_dropped": done.num_dropped,
    })


# ----------------------------------------------------------------------------- a chunk: what a worker does

_worker_tokenizer = None  # the tokenizer of this worker process (set by ``start_pool`` or ``encode_here``)


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
            conversations.append(parse_line(decode_line(raw_line)))
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


# ----------------------------------------------------------------------------- finding the cache


def cache_target(path: Path, tokenizer, max_seq_len: int, cache_root: Path) -> tuple[str, Path]:
    """The data file's digest and the directory its cache of this key has (finished or not)."""
    digest = data_digest(path, cache_root)
    return digest, Path(cache_root) / cache_key(digest, tokenizer, max_seq_len, TOKENS_VERSION, ROWS_VERSION)


def other_versions(meta: dict) -> str | None:
    """How a finished cache's record (``meta.json``) differs from this code's versions, in words
    ("records tokens version 3, not this code's 4"), or None when it is of them. A cache that records
    no rows version has the rules of ``UNRECORDED_ROWS_VERSION``."""
    if meta.get("tokens_version") != TOKENS_VERSION:
        return f"records tokens version {meta.get('tokens_version')}, not this code's {TOKENS_VERSION}"
    rows = meta.get("rows_version", UNRECORDED_ROWS_VERSION)
    if rows != ROWS_VERSION:
        return f"records rows version {rows}, not this code's {ROWS_VERSION}"
    return None


def check_bad_data_mode(bad_data: str) -> None:
    if bad_data not in BAD_DATA_MODES:
        raise ValueError(f"bad_data must be one of {BAD_DATA_MODES}, got {bad_data!r}")


def check_bad_data(meta: dict, bad_data: str) -> None:
    """In ``"error"`` mode a cache built in ``"skip"`` mode that skipped lines still raises."""
    if bad_data == "error" and meta["num_skipped"]:
        raise DataError(meta["first_bad_line"])


class CacheNotBuilt(RuntimeError):
    """A dataset was opened on a data file whose cache no build step has finished: the caller left
    out the build step (``build_or_reuse``), a bug in the code that opens the dataset."""


def open_finished(path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error") -> TokenCache:
    """The finished cache of this (data, tokenizer, ``max_seq_len``), opened; it builds nothing and
    runs no collective. ``CacheNotBuilt`` when that cache is missing or records another tokens or
    rows version (``build_or_reuse`` would build it); a damaged one is ``TokenCache``'s ``DataError``; in
    ``bad_data="error"`` mode a cache that skipped bad lines raises their ``DataError``, as its
    build does."""
    check_bad_data_mode(bad_data)
    _, target = cache_target(path, tokenizer, max_seq_len, cache_root)
    build_step = ("a dataset only opens a finished cache: build it first with dataset.cache.build_or_reuse (the "
                  "training script's step trainer/data_setup.build_token_caches), or open it with "
                  "dataset.build_cache_and_open")
    if not (target / "meta.json").is_file():
        raise CacheNotBuilt(f"{path}: its token cache {target} (this tokenizer, max_seq_len={max_seq_len}) is not "
                            f"built; {build_step}")
    cache = TokenCache(target)
    other = other_versions(cache.meta)
    if other:
        raise CacheNotBuilt(f"{path}: its token cache {target} {other}; {build_step}")
    check_bad_data(cache.meta, bad_data)
    return cache


def build_or_reuse(path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error",
                   num_proc: int | None = None, cores: set[int] | None = None) -> Path:
    """Return the cache directory for this data/tokenizer/max_seq_len, building it on this process
    if needed (``num_proc`` tokenizer processes, default: one per core it may use; ``cores``: where
    they may run, default: where this process may)."""
    num_proc = num_proc or default_num_proc()
    check_bad_data_mode(bad_data)
    check_data_file(path)
    digest, target = cache_target(path, tokenizer, max_seq_len, cache_root)
    why = None
    if (target / "meta.json").is_file():
        meta, problem = read_checked(target)
        why = f"is damaged ({problem})" if problem else other_versions(meta)
    elif os.path.lexists(target):
        # A finished cache is renamed into place with its meta.json: without one it is what a deletion
        # or a copy stopped halfway left, and the build's rename onto it would fail on every run.
        why = "is damaged (it has no meta.json)"
    if why:
        print_escaped(f"{path.name}: the token cache {target} {why}: building it again", file=sys.stderr)
        _remove_cache(target)
    if not (target / "meta.json").is_file():
        _report_older_caches(path, digest, tokenizer, max_seq_len, cache_root)
        build_cache(path, tokenizer, max_seq_len, target, bad_data, num_proc, **({"cores": cores} if cores else {}))
    check_bad_data(read_meta(target), bad_data)
    return target


def _report_older_caches(path: Path, digest: str, tokenizer, max_seq_len: int, cache_root: Path) -> None:
    """Say why a cache of these same bytes, tokenizer and max_seq_len built by older code is not used:
    its tokens version, else its rows version, and what this code's changed."""
    for tokens, rows, key in older_keys(digest, tokenizer, max_seq_len, TOKENS_VERSION, ROWS_VERSION):
        older = cache_root / key
        if not (older / "meta.json").is_file():
            continue
        if tokens != TOKENS_VERSION:
            why = (f"tokens version {tokens}; this code tokenizes as version {TOKENS_VERSION}: "
                   f"{TOKENS_CHANGES[TOKENS_VERSION]}")
        else:
            why = f"rows version {rows}; this code accepts rows as version {ROWS_VERSION}: {ROWS_CHANGES[ROWS_VERSION]}"
        print_escaped(f"{path.name}: not reusing the token cache {older}: it was built by older code ({why}); building "
                      "a new one (delete the old one once no older minisft uses it)", file=sys.stderr)


def _remove_cache(cache: Path) -> None:
    """Move a finished cache out of the way (a rename, so no reader sees half of it), then delete it."""
    aside = cache.with_name(f".removed-{cache.name}-{os.getpid()}")
    try:
        os.rename(cache, aside)
    except FileNotFoundError:  # another process moved it first
        return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
