"""The ranks of one node build a token cache together, through files (never a collective).

Under ``torch.distributed`` the local ranks of a node used to wait while local rank 0 tokenized
alone. Now they form a team (``node_build.prepare_cache``): local rank 0 is the lead, which owns
the partial build (``partial_build``: lock, committed rows, ``progress.json``) exactly as a
process building alone does; the others are helpers. The build's chunks (``CHUNK_LINES`` rows,
counted from the row the build starts at) are dealt out in turn: chunk ``c`` belongs to member
``c % size``. Each member tokenizes its own chunks with its own process pool; a helper writes
each result to the team directory (``<cache_root>/.team-<nonce>-node<N>/<c>.npz``, written under a
temporary name and renamed, so a file there is whole); the lead appends every chunk, in order,
to the partial build, taking a helper's chunk from its file and deleting the file. So the cache is
the one a single process builds, byte for byte, and it is committed, interrupted and resumed the
same way: a killed team leaves the lead's committed rows, and the next build (alone or in a team)
continues there; the files of chunks not yet appended are thrown away with the team directory.

The team directory holds ``plan.json`` (what the lead builds: the data file, the first row, the
number of members, rows per chunk; written when the build starts), ``lead.lock`` and one
``member-<i>.lock`` per helper, each ``flock``-ed by its process while it takes part (the kernel
drops it when the process dies), and ``member-<i>.left`` once a helper stopped (finished, or
failed: its error is printed and the lead does its part). The lead waits for a helper's chunk
until that helper has left, or holds no lock ``JOIN_GRACE_S`` after the plan (died, or never
came); a chunk of a helper that is gone, it tokenizes itself (the same bytes either way). A helper stops when the plan is gone (the lead
finished or failed) or the lead's lock is free, and never has more than ``AHEAD_CHUNKS`` chunk
files waiting, so memory and disk stay bounded.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

TEAM_PREFIX = ".team-"
POLL_S = 0.02
JOIN_GRACE_S = 10.0
AHEAD_CHUNKS = 4  # chunk files a helper may have waiting for the lead


def _lock(path: Path):
    """The open, ``flock``-ed file, or None if another process holds it."""
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return handle


def _held(path: Path) -> bool:
    """Is ``path`` ``flock``-ed by a live process (False if it does not exist)."""
    try:
        handle = _lock(path)
    except FileNotFoundError:
        return False
    if handle is None:
        return True
    handle.close()
    return False


class Team:
    """One node's team for one data file: ``size`` members, this process being ``member``."""

    def __init__(self, cache_root: Path, nonce: str, node: int, size: int, member: int):
        self.dir = Path(cache_root) / f"{TEAM_PREFIX}{nonce}-node{node}"
        self.size, self.member = size, member
        self._lock = None

    def _member_lock(self, member: int) -> Path:
        return self.dir / ("lead.lock" if member == 0 else f"member-{member}.lock")

    def join(self) -> None:
        """Take this member's lock (held until ``leave``). Others test it by taking it for an
        instant, so a busy lock is tried again (for up to ``JOIN_GRACE_S``)."""
        deadline = time.monotonic() + JOIN_GRACE_S
        while self._lock is None and time.monotonic() < deadline:
            self.dir.mkdir(parents=True, exist_ok=True)  # a stale-team cleanup may remove it while it holds no lock
            try:
                self._lock = _lock(self._member_lock(self.member))
            except FileNotFoundError:
                continue
            if self._lock is None:
                time.sleep(POLL_S)

    def leave(self) -> None:
        """Stop taking part; a helper says so (``member-<i>.left``), so the lead takes its chunks at once."""
        if self._lock is not None:
            if self.member:
                with contextlib.suppress(OSError):
                    (self.dir / f"member-{self.member}.left").touch()
            self._lock.close()
            self._lock = None

    @property
    def joined(self) -> bool:
        return self._lock is not None

    def alive(self, member: int) -> bool:
        return _held(self._member_lock(member))

    def gone(self, member: int, since_plan: float) -> bool:
        """A helper that left, or that holds no lock ``JOIN_GRACE_S`` after the plan (died, never came)."""
        if (self.dir / f"member-{member}.left").exists():
            return True
        return since_plan > JOIN_GRACE_S and not self.alive(member)

    # ------------------------------------------------------------------ the plan

    def publish(self, plan: dict) -> None:
        """The lead starts: its lock, then the plan (the helpers start on it)."""
        self.join()
        tmp = self.dir / f"plan.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps({**plan, "size": self.size, "published": time.time()}), encoding="utf-8")
        os.replace(tmp, self.dir / "plan.json")

    def plan(self) -> dict | None:
        try:
            return json.loads((self.dir / "plan.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """The lead is done (finished, failed or interrupted): the helpers stop; nothing is kept."""
        (self.dir / "plan.json").unlink(missing_ok=True)
        self.leave()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ chunks

    def _chunk(self, number: int) -> Path:
        return self.dir / f"{number}.npz"

    def waiting(self) -> int:
        """This helper's chunk files the lead has not taken yet."""
        return sum(1 for path in self.dir.glob("*.npz") if path.stem.isdigit() and int(path.stem) % self.size == self.member)

    def put(self, number: int, result: dict) -> None:
        """Write chunk ``number``'s result (``chunks.encode_chunk``'s dict) for the lead."""
        tmp = self.dir / f".{number}.npz.tmp{os.getpid()}"  # never matches *.npz while it is written
        info = json.dumps({"bad": result["bad"], "dropped": result["dropped"], "rows": result["rows"]}).encode("utf-8")
        with open(tmp, "wb") as handle:
            np.savez(handle, ids=result["ids"], mask=result["mask"], lengths=result["lengths"],
                     info=np.frombuffer(info, dtype=np.uint8))
        os.replace(tmp, self._chunk(number))

    def take(self, number: int) -> dict | None:
        """Chunk ``number``'s result if its file is there (the file is removed), else None."""
        path = self._chunk(number)
        try:
            with np.load(path) as arrays:
                info = json.loads(arrays["info"].tobytes().decode("utf-8"))
                result = {"ids": arrays["ids"], "mask": arrays["mask"], "lengths": arrays["lengths"]}
        except FileNotFoundError:
            return None
        path.unlink()
        return {**result, "bad": [tuple(bad) for bad in info["bad"]], "dropped": info["dropped"], "rows": info["rows"]}


class deferred:
    """``submit`` for a lead without a pool: the chunk is tokenized here when its result is wanted."""

    def __init__(self, function: Callable):
        self.function = function

    def __call__(self, task):
        return _Deferred(self.function, task)


class _Deferred:
    def __init__(self, function: Callable, task):
        self.function, self.task = function, task

    def get(self):
        return self.function(self.task)


def ordered_results(team: Team, tasks: Iterator, submit: Callable, window: int) -> Iterator[dict]:
    """The lead's chunk results in order: its own chunks through ``submit(task)`` (something with
    ``.get()``), the helpers' from their files; at most ``window`` chunks read ahead. A helper's
    chunk is waited for while that helper takes part, else the lead tokenizes it itself."""
    published = time.monotonic()
    pending: collections.deque = collections.deque()

    def resolve(number, task, result):
        if result is not None:
            return result.get()
        owner = number % team.size
        while True:
            taken = team.take(number)
            if taken is not None:
                return taken
            if team.gone(owner, time.monotonic() - published):
                return submit(task).get()  # its helper is gone (or never came): tokenized here
            time.sleep(POLL_S)

    for number, task in enumerate(tasks):
        pending.append((number, task, submit(task) if number % team.size == 0 else None))
        if len(pending) > window:
            yield resolve(*pending.popleft())
    while pending:
        yield resolve(*pending.popleft())


def remove_stale_teams(cache_root: Path) -> None:
    """Remove team directories whose members are all gone (a killed run's); live ones stay."""
    for directory in Path(cache_root).glob(f"{TEAM_PREFIX}*"):
        if not any(_held(lock) for lock in directory.glob("*.lock")):
            shutil.rmtree(directory, ignore_errors=True)
