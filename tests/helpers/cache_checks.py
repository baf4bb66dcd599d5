"""What a token cache's folder holds (its partial builds, a finished cache's files), and a live
process that holds a partial build's lock as a builder does."""

import subprocess
import sys
from pathlib import Path


def partials(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.glob(".partial-*")) if cache_root.is_dir() else []


def cache_files(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.iterdir())}


def hold_lock(lock: Path, seconds: float) -> subprocess.Popen:
    """A live process that holds a partial build's lock (as a builder does) for ``seconds``."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.seek(0); f.truncate(); f.write('otherhost.4242'); f.flush(); print('locked', flush=True); "
            "time.sleep(float(sys.argv[2]))")
    lock.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", code, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process
