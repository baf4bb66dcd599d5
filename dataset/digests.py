"""A data file's identity: the sha256 of its bytes, memoized per file version under a cheap key, so
an unchanged multi-GB file is hashed once, not at every start."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SAMPLED_BLOCKS = 16
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
    multi-GB file is not re-read at every start."""
    memo = Path(cache_root) / ".digests" / cheap_file_key(path)
    if memo.is_file():
        return memo.read_text(encoding="utf-8").strip()
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
