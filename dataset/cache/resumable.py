"""A token-cache build that survives being killed: finished rows are kept and a restart continues.

The build of cache ``<cache_root>/<key>/`` happens in ``<cache_root>/.partial-<key>/``:

* ``lock``           ``flock``-ed by the building process (the kernel releases it when that process
                     dies, ``kill -9`` included); holds ``host.pid`` for the waiting message
* ``cache/``         ``tokens.bin`` and ``loss_mask.bin``, appended chunk by chunk; at the end
                     ``offsets.npy`` and ``meta.json`` are added and ``cache/`` is renamed to the cache
* ``lengths.bin``    int64 token count of every sample so far (``offsets.npy`` is made from it)
* ``progress.json``  the last commit: rows of the data file read, samples (and their digest), tokens,
                     bad and dropped rows. Written atomically (temporary file + rename) after the data files are
                     fsync-ed, at most every ``COMMIT_S`` seconds, and when the build stops.

A restart with the same key (same file bytes, tokenizer, template, ``max_seq_len``) truncates
the data files to the committed sizes (a killed process may have written half a chunk after its
last commit) and continues at the committed row, so the cache is byte-identical to one built
without interruption. A partial build whose lock is held belongs to a live process and is
never touched: a second builder of the same key waits for it (and continues its work if it
dies). Partial builds of an older version of the same data file, and leftovers of finished
caches, are removed by the next build in that cache directory.

A file that cannot be written (a full disk, a file size limit, no permission) raises
``CacheWriteError``, one line naming the file and the cause; what was committed before stays.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..formats import DataError
from ..printable import print_escaped
from . import waiting

PARTIAL_PREFIX = ".partial-"
PROGRESS_VERSION = 2  # a partial build of another version starts afresh (1 holds no samples_digest)
COMMIT_S = 2.0  # most seconds of tokenizing a kill may lose
OFFSETS_BLOCK = 1 << 20  # samples per block when writing offsets.npy


@dataclass
class Progress:
    """What the committed part of a partial build holds (``progress.json``)."""

    key: str
    data_file: str
    data_digest: str
    total_rows: int
    rows: int = 0  # rows (lines) of the data file consumed, blank and bad ones included
    samples: int = 0
    tokens: int = 0
    num_skipped: int = 0
    first_bad_line: str | None = None
    num_dropped: int = 0
    samples_digest: str = ""  # `chain_samples` over the committed samples
    version: int = PROGRESS_VERSION
    # How the run that made this commit ended: None while it runs (so a killed run leaves None), the
    # signal's name ("SIGTERM") when one interrupted it, else the error that stopped it.
    stopped: str | None = None


class CacheWriteError(DataError):
    """A token-cache file could not be written (full disk, file size limit, permissions): one line
    naming the file and the cause. The rows committed before stay for the next run."""


@contextlib.contextmanager
def writing(path: Path):
    """Turn an ``OSError`` raised while writing ``path`` into ``CacheWriteError`` (a buffered
    write's error names no file: ``path`` does)."""
    try:
        yield
    except OSError as exc:
        name = exc.filename if isinstance(exc.filename, (str, os.PathLike)) else path
        raise CacheWriteError(f"could not write the token cache {name}: {exc.strerror or exc} "
                              "(the rows committed so far are kept for the next run)") from None


def partial_dir(target: Path) -> Path:
    return target.parent / f"{PARTIAL_PREFIX}{target.name}"


def read_progress(directory: Path) -> Progress | None:
    try:
        record = json.loads((directory / "progress.json").read_text(encoding="utf-8"))
        return Progress(**record) if record.get("version") == PROGRESS_VERSION else None
    except (OSError, ValueError, TypeError):
        return None


def _try_lock(lock_path: Path):
    """The open, ``flock``-ed lock file, or None if another live process holds it."""
    handle = open(lock_path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return handle


class PartialBuild:
    """The partial build of ``target``, owned by this process between ``claim`` and ``release``."""

    def __init__(self, target: Path, token_dtype: np.dtype):
        self.target = target
        self.dir = partial_dir(target)
        self.cache = self.dir / "cache"
        self.dtype = np.dtype(token_dtype)
        self.progress: Progress | None = None
        self.earlier: Progress | None = None  # the committed build that ``resume`` continues
        self._committed: dict | None = None  # what progress.json holds now
        self._lock = None
        self._files: dict = {}
        self._last_commit = time.monotonic()

    # ------------------------------------------------------------------ ownership

    def claim(self) -> bool:
        """Take the lock, waiting while another live process builds this cache. False: the cache
        was finished meanwhile (by that process); nothing to do."""
        lines = waiting.WaitLines(first_s=0.0)  # the lock holder is known at once
        while not (self.target / "meta.json").is_file():
            with writing(self.dir):
                self.dir.mkdir(parents=True, exist_ok=True)
            try:
                with writing(self.dir / "lock"):
                    self._lock = _try_lock(self.dir / "lock")
            except CacheWriteError:
                if not self.dir.is_dir():  # the finished builder removed the directory just now
                    continue
                raise
            if self._lock is not None:
                if (self.target / "meta.json").is_file():  # finished between our check and the lock
                    self.discard()
                    return False
                with writing(self.dir / "lock"):
                    self._lock.seek(0)
                    self._lock.truncate()
                    self._lock.write(f"{socket.gethostname()}.{os.getpid()}")
                    self._lock.flush()
                return True
            lines.say_if_due(lambda: f"waiting for process {self._lock_holder()}, which is building this token "
                                     f"cache, {self.target}")
            time.sleep(waiting.WAIT_POLL_S)
        return False

    def _lock_holder(self) -> str:
        """``host.pid`` of the process that holds the lock, as it wrote it there."""
        return (self.dir / "lock").read_text(encoding="utf-8").strip() or "another process"

    def release(self, stopped: str | None = None) -> None:
        """Commit what is finished, with how the build ``stopped`` (a signal's name or the error), and
        let go of the lock (the partial build stays for a restart).

        Files are still open here only when the build stopped early, with an exception on its way
        out; a commit that fails now (the disk is still full) keeps the previous ``progress.json``
        and raises nothing: the first error is the one to report, not the same one again."""
        if self._lock is None:
            return
        try:
            if self._files:
                self.progress.stopped = stopped
                try:
                    self.commit(force=True)
                except CacheWriteError:  # at least say how the committed part stopped, if that fits
                    self._record_stop(stopped)
        finally:
            self._close_files(quiet=True)
            self._lock.close()
            self._lock = None

    def discard(self) -> None:
        """Remove the partial build (owned)."""
        self._close_files()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ------------------------------------------------------------------ progress

    def resume(self, key: str, data_file: str, data_digest: str, count_rows) -> Progress:
        """Continue the committed build if it is of this key and file digest, else start afresh
        (``count_rows()`` gives the file's number of rows then). Opens the data files for
        appending, cut back to the committed sizes."""
        old = read_progress(self.dir)
        sizes = {}
        if old is not None and (old.key, old.data_digest) == (key, data_digest):
            sizes = {"tokens.bin": old.tokens * self.dtype.itemsize, "loss_mask.bin": old.tokens, "lengths.bin": old.samples * 8}
            if all(self._path(name).is_file() and self._path(name).stat().st_size >= size for name, size in sizes.items()):
                self.earlier = Progress(**asdict(old))
                self._committed = asdict(old)
                self.progress = old
                self.progress.stopped = None  # running again
            else:
                print_escaped(f"{self.dir}: the partial token cache is shorter than its progress record; starting "
                              "it again", file=sys.stderr)
        if self.progress is None:
            (self.dir / "progress.json").unlink(missing_ok=True)
            self.progress = Progress(key, data_file, data_digest, count_rows())
            sizes = {"tokens.bin": 0, "loss_mask.bin": 0, "lengths.bin": 0}
        with writing(self.cache):
            self.cache.mkdir(parents=True, exist_ok=True)
        for name, size in sizes.items():
            with writing(self._path(name)):
                with open(self._path(name), "ab") as handle:
                    handle.truncate(size)
                self._files[name] = open(self._path(name), "ab")
        return self.progress

    def _path(self, name: str) -> Path:
        return self.dir / name if name == "lengths.bin" else self.cache / name

    def append(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, rows: int, bad: list[str], dropped: int) -> None:
        """Add one chunk's results (``bad``: its skipped rows as ``file:line: problem``). The counters
        change only after every file got its bytes, so a commit never counts a half-written chunk."""
        ids, mask = ids.astype(self.dtype), mask.astype(np.uint8)
        for name, array in (("tokens.bin", ids), ("loss_mask.bin", mask), ("lengths.bin", lengths.astype(np.int64))):
            with writing(self._path(name)):
                self._files[name].write(array.tobytes())
        progress = self.progress
        progress.samples_digest = chain_samples(progress.samples_digest, ids, mask, lengths)
        progress.rows += rows
        progress.samples += len(lengths)
        progress.tokens += len(ids)
        progress.num_skipped += len(bad)
        progress.first_bad_line = progress.first_bad_line or (bad[0] if bad else None)
        progress.num_dropped += dropped
        self.commit()

    def commit(self, force: bool = False) -> None:
        """Make the appended chunks durable: fsync the data, then replace ``progress.json``."""
        if not force and time.monotonic() - self._last_commit < COMMIT_S:
            return
        for name, handle in self._files.items():
            with writing(self._path(name)):
                handle.flush()
                os.fsync(handle.fileno())
        tmp = self.dir / f"progress.json.tmp{os.getpid()}"
        try:
            with writing(tmp):
                record = asdict(self.progress)
                tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
                os.replace(tmp, self.dir / "progress.json")
        except CacheWriteError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        self._committed = record
        self._last_commit = time.monotonic()

    def _record_stop(self, stopped: str | None) -> None:
        """Rewrite ``progress.json`` with its counters unchanged and ``stopped`` set (best effort)."""
        if self._committed is None:
            return
        tmp = self.dir / f"progress.json.tmp{os.getpid()}"
        try:
            tmp.write_text(json.dumps({**self._committed, "stopped": stopped}, indent=1), encoding="utf-8")
            os.replace(tmp, self.dir / "progress.json")
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def _close_files(self, quiet: bool = False) -> None:
        """Close the data files; ``quiet``: a close that fails to flush (full disk) raises nothing
        (the file is closed all the same)."""
        for handle in self._files.values():
            try:
                handle.close()
            except OSError:
                if not quiet:
                    raise
        self._files = {}

    # ------------------------------------------------------------------ the end

    def finish(self, meta: dict) -> None:
        """Write ``offsets.npy`` and ``meta.json``, move the cache into place, remove the rest."""
        self.commit(force=True)
        self._close_files()
        with writing(self.cache / "offsets.npy"):
            write_offsets(self.dir / "lengths.bin", self.progress.samples, self.cache / "offsets.npy")
        meta_path = self.cache / "meta.json"
        with writing(meta_path):
            meta_path.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        for name in ("tokens.bin", "loss_mask.bin", "offsets.npy", "meta.json"):
            with writing(self.cache / name), open(self.cache / name, "rb") as handle:
                os.fsync(handle.fileno())
        try:
            os.rename(self.cache, self.target)
        except OSError as exc:
            if not (self.target / "meta.json").is_file():  # not a finished cache of another host
                with writing(self.target):
                    raise exc
        self.discard()


def chain_samples(digest: str, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> str:
    """``digest`` (of the samples before) chained over these samples, one sha256 each over the digest
    before it, the sample's tokens and its loss mask: which samples a cache holds, in order, the same
    however the build cut its rows into chunks or was interrupted. Two caches of the same tokenizer and
    max_seq_len have the same digest exactly when they hold the same samples in the same order."""
    start = 0
    for length in lengths.tolist():
        digest = hashlib.sha256(digest.encode() + ids[start:start + length].tobytes()
                                + mask[start:start + length].tobytes()).hexdigest()
        start += length
    return digest


def write_offsets(lengths_path: Path, samples: int, out: Path) -> None:
    """``offsets.npy`` (int64, ``samples + 1``: the cumulative sum of the lengths from 0), the
    same bytes as ``np.save``, written block by block so that memory stays flat."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)), "fortran_order": False, "shape": (samples + 1,)}
    with open(out, "wb") as dst, open(lengths_path, "rb") as src:
        np.lib.format.write_array_header_1_0(dst, header)
        total = np.zeros(1, dtype=np.int64)
        dst.write(total.tobytes())
        while True:
            block = np.fromfile(src, dtype=np.int64, count=OFFSETS_BLOCK)
            if not len(block):
                break
            sums = np.cumsum(block) + total[0]
            dst.write(sums.tobytes())
            total[0] = sums[-1]


def remove_stale_partials(cache_root: Path, data_file: str, data_digest: str) -> list[Path]:
    """Remove partial builds nobody will continue: of an older version of ``data_file`` (another
    digest), or whose cache is finished. Those held by a live process are left alone."""
    removed = []
    for directory in cache_root.glob(f"{PARTIAL_PREFIX}*"):
        progress = read_progress(directory)
        finished = (cache_root / directory.name[len(PARTIAL_PREFIX):] / "meta.json").is_file()
        outdated = progress is not None and progress.data_file == data_file and progress.data_digest != data_digest
        if not (finished or outdated):
            continue
        try:
            lock = _try_lock(directory / "lock")
        except FileNotFoundError:
            continue
        if lock is None:
            continue
        shutil.rmtree(directory, ignore_errors=True)
        lock.close()
        removed.append(directory)
    return removed
