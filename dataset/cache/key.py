"""What names a token cache: the data file's bytes (their sha256, memoized per file version under a
cheap key, so an unchanged multi-GB file is hashed once, not at every start), the tokenizer and its
chat template, ``max_seq_len`` and the versions of the layout, of the code that makes tokens and of
the rules that decide which rows are accepted."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from ..formats import DataError
from ..rendering import tokenizer_fingerprint

CACHE_VERSION = 1  # the layout of the files
# The version of everything besides the tokenizer (whose fingerprint is in the key already) that
# decides a row's tokens and loss mask: reading lines (sources), parsing (formats), rendering and
# loss spans (rendering, tokens), truncation to max_seq_len, which samples are dropped for having no
# loss token (cache.build); which rows are bad has a version of its own (ROWS_VERSION, below). Every
# change to the tokens or labels of any accepted row needs a new version, or caches
# built by another version's code are reused: tests/dataset/test_tokens_version.py holds a digest of the
# tokens and labels of fixed conversations per version and fails when they change without one.
TOKENS_VERSION = 4
TOKENS_CHANGES = {  # what each version changed, for the line that says why a cache is built again
    1: "caches of the code before versions were recorded (it may predate tool calls and reasoning)",
    2: "tool definitions, tool calls, tool results and reasoning are rendered by the chat template and learned",
    3: "only a leading think block is reasoning, NaN/Infinity make a line bad, parquet struct nulls are absent keys",
    4: "special-token text in JSON keys is text, and a tokenizer whose pieces are not proven to tokenize as the "
       "whole text (sentencepiece's Metaspace 'first') is tokenized whole",
}
# The version of the rules that decide which rows are accepted (bad lines, `file:line: ...`) where the
# tokens of the accepted rows stay those of TOKENS_VERSION. A cache built under other rules may hold
# rows this code refuses or lack rows it keeps, so it is built again; a resume is not refused for it
# (trainer/run_identity.py compares each file's samples: their number, and their digest where both
# caches record one, `samples_digest` in meta.json, so it refuses a file that lost and gained rows).
# Every change of which rows are accepted needs a new version: tests/dataset/test_rows_version.py
# holds the bad lines of fixed rows per version and fails when they change without one.
ROWS_VERSION = 2
ROWS_CHANGES = {  # what each version changed, for the line that says why a cache is built again
    1: "the rules of the caches that record no rows version",
    2: "a row is bad where it holds a key twice in one JSON object, both 'conversations' and 'messages', a tool "
       "call of a type other than 'function', in two forms or with call keys inside 'function', a non-empty "
       "'functions', or tools, tool calls or reasoning the chat template does not render; a null or empty "
       "'conversations', 'messages' or call key counts as absent; a reply that repeats an earlier turn under "
       "Qwen3's template is kept",
}
UNRECORDED_ROWS_VERSION = 1  # the rules of a cache whose meta.json records no rows version


SYSTEM_DIRS = (Path("/dev"), Path("/proc"), Path("/sys"))  # no cache is written beside a file in these


def default_cache_root(data_path: Path, cache_dir) -> Path:
    """``cache_dir``, else ``.cache`` beside the data file; a file in a system directory (``/dev/stdin``,
    ``/proc/self/fd/0``) has no place beside it for a cache: a one-line ``DataError`` asks for ``--cache_dir``."""
    if cache_dir is not None:
        return Path(cache_dir)
    folder = Path(os.path.abspath(data_path)).parent
    if any(folder == system or system in folder.parents for system in SYSTEM_DIRS):
        raise DataError(f"{data_path}: its token cache would be written beside it, in {folder}; give --cache_dir DIR "
                        "for the cache, or write the data to a file")
    return folder / ".cache"


def cache_key(data_digest: str, tokenizer, max_seq_len: int, tokens_version: int, rows_version: int) -> str:
    """Directory name of the cache for this (data, tokenizer, template, max_seq_len, versions);
    ``tokens_version=1`` gives the key of caches whose tokens version is not part of their key,
    ``rows_version=1`` that of caches whose rows version is not."""
    return _versioned_key(_unversioned_parts(data_digest, tokenizer, max_seq_len), tokens_version, rows_version)


def measurement_key(data_digest: str, tokenizer, max_seq_len: int) -> str:
    """What names the samples a file's figures (a held-out file's evaluation) are measured on, apart
    from which of its rows are accepted: the key of its cache with the rows version left out, that of
    ``UNRECORDED_ROWS_VERSION`` (so a record of a run of those rules names the same key). Rules that
    accept the same rows give the same samples and so comparable figures: a change of ROWS_VERSION
    alone leaves this key; which rows are accepted is recorded beside it (trainer.evaluation.selection)."""
    return cache_key(data_digest, tokenizer, max_seq_len, TOKENS_VERSION, UNRECORDED_ROWS_VERSION)


def older_keys(data_digest: str, tokenizer, max_seq_len: int, tokens_version: int,
               rows_version: int) -> list[tuple[int, int, str]]:
    """``(tokens version, rows version, key)`` of every cache of this (data, tokenizer, template,
    max_seq_len) that other code may have built, and only those: every tokens version below
    ``tokens_version`` with rows version 1 (rows versions above 1 are those of ``tokens_version``), and
    ``tokens_version`` with every rows version below ``rows_version``."""
    parts = _unversioned_parts(data_digest, tokenizer, max_seq_len)
    pairs = [(tokens, 1) for tokens in range(1, tokens_version)] + [(tokens_version, rows)
                                                                   for rows in range(1, rows_version)]
    return [(tokens, rows, _versioned_key(parts, tokens, rows)) for tokens, rows in pairs]


def _unversioned_parts(data_digest: str, tokenizer, max_seq_len: int) -> list[str]:
    return [f"v{CACHE_VERSION}", data_digest, tokenizer_fingerprint(tokenizer), str(max_seq_len)]


def _versioned_key(parts: list[str], tokens_version: int, rows_version: int) -> str:
    parts = [*parts, *([f"tokens{tokens_version}"] if tokens_version > 1 else []),
             *([f"rows{rows_version}"] if rows_version > 1 else [])]
    return hashlib.sha256("|".join(parts).encode("utf-8")).hexdigest()[:24]


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SAMPLED_BLOCKS = 16
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # what a memo of .digests holds
SAMPLED_BLOCK_BYTES = 1 << 16


def cheap_file_key(path: Path) -> str:
    """sha256 of the size, mtime, inode number, inode change time and ``SAMPLED_BLOCKS`` evenly spaced
    blocks: reads ~1 MiB of any file.

    The inode change time (``st_ctime_ns``) is what notices an edit that keeps the size and sets the
    mtime back (``rsync -a``, ``cp -p``, ``touch -r``, ``os.utime``): the kernel sets it to the current
    time at every write and at every ``utime`` itself, and no system call sets it to a chosen value. A
    file replaced by another one (a new inode) changes the inode number. The device number is left
    out: one shared file has other device numbers on other nodes, which share the memo."""
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}|{stat.st_ctime_ns}".encode())
    with path.open("rb") as f:
        for i in range(SAMPLED_BLOCKS):
            f.seek(stat.st_size * i // SAMPLED_BLOCKS)
            digest.update(f.read(SAMPLED_BLOCK_BYTES))
    return digest.hexdigest()


def data_digest(path: Path, cache_root: Path) -> str:
    """The file's full sha256, hashed once per file version: memoized under ``cache_root/.digests``
    by ``cheap_file_key`` (size, mtime, inode, inode change time, sampled blocks), so an unchanged
    multi-GB file is not re-read at every start. A memo that holds no sha256 (empty after a crash lost
    its write, damaged) is hashed again: taken as it is, it would key this file's cache, and that of
    every other file with such a memo, by the same text."""
    memo = Path(cache_root) / ".digests" / cheap_file_key(path)
    if memo.is_file():
        recorded = memo.read_text(encoding="utf-8", errors="replace").strip()
        if SHA256_HEX.fullmatch(recorded):
            return recorded
    digest = file_digest(path)
    tmp = memo.with_name(memo.name + f".tmp{os.getpid()}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest, encoding="utf-8")
        os.replace(tmp, memo)
    except OSError:  # a full disk, a read-only cache of finished caches: hashed again next time, nothing lost
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return digest
