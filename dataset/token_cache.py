"""Tokenize a jsonl file once into a memory-mapped on-disk cache.

Layout of ``<cache_root>/<key>/``:

* ``tokens.bin``    flat token ids, smallest unsigned dtype that fits the vocab (uint16 for 6400)
* ``loss_mask.bin`` flat uint8, 1 where the token carries loss
* ``offsets.npy``   int64 (n + 1,), sample ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``
* ``meta.json``     counts (samples, tokens, skipped bad lines, dropped samples) and the dtype

``key`` hashes the data file's bytes, the tokenizer fingerprint (vocab, merges, special tokens,
chat template), ``max_seq_len`` and ``CACHE_VERSION``. A cache is written to a temporary
directory and renamed into place, so a crash never leaves a half-written cache. Lines are
tokenized by a process pool over chunks of lines. Under ``torch.distributed`` only local rank 0
builds; every rank then learns the result (cache path or error message) through a collective,
so an error raises the same ``DataError`` on all ranks instead of hanging them.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .formats import DataError, LineError, parse_line
from .rendering import encode_conversation, token_dtype, tokenizer_fingerprint

CACHE_VERSION = 1
CHUNK_LINES = 512
BAD_DATA_MODES = ("error", "skip")

_worker_tokenizer = None  # set in each pool worker by _init_worker


def default_num_proc() -> int:
    return min(8, os.cpu_count() or 1)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(data_digest: str, tokenizer, max_seq_len: int) -> str:
    """Directory name of the cache for this (data, tokenizer, template, max_seq_len, version)."""
    parts = [f"v{CACHE_VERSION}", data_digest, tokenizer_fingerprint(tokenizer), str(max_seq_len)]
    return hashlib.sha256("|".join(parts).encode("utf-8")).hexdigest()[:24]


def check_data_file(path: Path) -> None:
    """Raise a one-line ``DataError`` if the data file is missing, a directory, a JSON array or has no
    non-blank line."""
    if path.is_dir():
        raise DataError(f"{path}: is a directory; --data_path takes a .jsonl file (one conversation per line)")
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    with path.open("rb") as f:
        first = next((line.strip().removeprefix(b"\xef\xbb\xbf").lstrip() for line in f if line.strip()), b"")
    if not first:
        raise DataError(f"{path}: data file is empty")
    if first.startswith(b"[") and not _is_json(first):
        raise DataError(
            f"{path}: is one JSON array, not JSON Lines (one conversation object per line); "
            "convert it first, e.g. jq -c '.[]' in.json > out.jsonl"
        )


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return False
    return True


# ----------------------------------------------------------------------------- building


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _init_pool_worker(tokenizer) -> None:
    # A forked worker inherits the parent's Python signal handlers (the trainer turns SIGTERM
    # into a "stop at the next step" flag); Pool.terminate() needs SIGTERM to end the worker.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer)


def _encode_chunk(task: tuple[int, list[bytes], int]) -> dict:
    """Parse and encode one chunk of lines (``first_line`` is the 1-based number of ``lines[0]``)."""
    first_line, lines, max_seq_len = task
    tokenizer = _worker_tokenizer
    ids_parts, mask_parts, lengths, bad = [], [], [], []
    dropped = 0
    for line_number, raw_line in enumerate(lines, start=first_line):
        if not raw_line.strip():
            continue
        try:
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LineError(f"invalid UTF-8 at byte {exc.start}") from None
            ids, mask = encode_conversation(tokenizer, parse_line(line), max_seq_len)
        except LineError as exc:
            bad.append((line_number, str(exc)))
            continue
        if not mask.any():
            dropped += 1
            continue
        ids_parts.append(ids)
        mask_parts.append(mask)
        lengths.append(len(ids))
    return {
        "ids": np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64),
        "mask": np.concatenate(mask_parts) if mask_parts else np.zeros(0, dtype=bool),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "bad": bad,
        "dropped": dropped,
    }


def _iter_chunks(path: Path, max_seq_len: int) -> Iterator[tuple[int, list[bytes], int]]:
    with path.open("rb") as f:
        lines: list[bytes] = []
        first_line = 1
        for number, line in enumerate(f, start=1):
            if not lines:
                first_line = number
            lines.append(line)
            if len(lines) == CHUNK_LINES:
                yield first_line, lines, max_seq_len
                lines = []
        if lines:
            yield first_line, lines, max_seq_len


def _count_chunks(path: Path) -> int:
    with path.open("rb") as f:
        num_lines = sum(1 for _ in f)
    return -(-num_lines // CHUNK_LINES)


def _pool_context():
    """Fork where available (fast, no re-import of the caller's main module), else spawn."""
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def build_cache(path: Path, tokenizer, max_seq_len: int, target: Path, bad_data: str, num_proc: int) -> None:
    """Tokenize ``path`` into the cache directory ``target`` (written atomically).

    With ``bad_data="error"`` the first bad line raises ``DataError`` (nothing is written); with
    ``"skip"`` bad lines are counted and the first one is recorded in ``meta.json``.
    """
    dtype = token_dtype(len(tokenizer))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    num_workers = min(num_proc, _count_chunks(path))
    pool = None
    try:
        if num_workers > 1:
            pool = _pool_context().Pool(num_workers, _init_pool_worker, (tokenizer,))
        if pool is None:
            _init_worker(tokenizer)
            results = map(_encode_chunk, _iter_chunks(path, max_seq_len))
        else:
            results = pool.imap(_encode_chunk, _iter_chunks(path, max_seq_len))
        lengths, num_bad, first_bad, dropped = [], 0, None, 0
        with open(tmp_dir / "tokens.bin", "wb") as tokens_file, open(tmp_dir / "loss_mask.bin", "wb") as mask_file:
            for result in results:
                if result["bad"]:
                    line_number, message = result["bad"][0]
                    if bad_data == "error":
                        raise DataError(f"{path}:{line_number}: {message}")
                    num_bad += len(result["bad"])
                    first_bad = first_bad or f"{path}:{line_number}: {message}"
                dropped += result["dropped"]
                tokens_file.write(result["ids"].astype(dtype).tobytes())
                mask_file.write(result["mask"].astype(np.uint8).tobytes())
                lengths.append(result["lengths"])
        lengths = np.concatenate(lengths)
        if len(lengths) == 0:
            raise DataError(
                f"{path}: no usable samples ({num_bad} bad lines skipped, {dropped} samples without "
                f"loss tokens after truncation to max_seq_len={max_seq_len})"
            )
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(tmp_dir / "offsets.npy", offsets)
        meta = {
            "version": CACHE_VERSION,
            "data_file": str(path),
            "max_seq_len": max_seq_len,
            "vocab_size": len(tokenizer),
            "dtype": dtype.name,
            "num_samples": int(len(lengths)),
            "num_tokens": int(offsets[-1]),
            "num_skipped": num_bad,
            "first_bad_line": first_bad,
            "num_dropped": dropped,
        }
        (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.rename(tmp_dir, target)
        except OSError:
            if not (target / "meta.json").is_file():  # not a concurrent builder's finished cache
                raise
    finally:
        _init_worker(None)
        if pool is not None:
            pool.terminate()
            pool.join()
        shutil.rmtree(tmp_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- loading


def read_meta(cache: Path) -> dict:
    return json.loads((cache / "meta.json").read_text(encoding="utf-8"))


def check_bad_data(meta: dict, bad_data: str) -> None:
    """In ``"error"`` mode a cache built in ``"skip"`` mode that skipped lines still raises."""
    if bad_data == "error" and meta["num_skipped"]:
        raise DataError(meta["first_bad_line"])


def build_or_reuse(path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str, num_proc: int) -> Path:
    """Return the cache directory for this data/tokenizer/max_seq_len, building it if needed."""
    if bad_data not in BAD_DATA_MODES:
        raise ValueError(f"bad_data must be one of {BAD_DATA_MODES}, got {bad_data!r}")
    check_data_file(path)
    target = cache_root / cache_key(file_digest(path), tokenizer, max_seq_len)
    if not (target / "meta.json").is_file():
        build_cache(path, tokenizer, max_seq_len, target, bad_data, num_proc)
    check_bad_data(read_meta(target), bad_data)
    return target


def prepare_cache(
    path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error", num_proc: int | None = None
) -> Path:
    """``build_or_reuse`` on this process, or on local rank 0 only under ``torch.distributed``.

    Every rank gathers (error, cache path) from all ranks; if any builder failed, all ranks raise
    the same ``DataError``. With NCCL, set the CUDA device before (``all_gather_object`` needs it).
    """
    num_proc = num_proc or default_num_proc()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    result: tuple[str | None, str | None] = (None, None)
    if local_rank == 0:
        try:
            result = (None, str(build_or_reuse(path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)))
        except DataError as exc:
            result = (str(exc), None)
        except Exception as exc:  # noqa: BLE001 - must reach the other ranks, not hang them
            result = (f"building the token cache failed on rank {dist.get_rank()}: {type(exc).__name__}: {exc}", None)
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)  # also the barrier: non-builders wait here
    errors = [error for error, _ in results if error is not None]
    if errors:
        raise DataError(errors[0])
    builder_rank = dist.get_rank() - local_rank
    return Path(results[builder_rank][1])
