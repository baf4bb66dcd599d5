"""What a token cache's folder holds (its partial builds, a finished cache's files), the key a data
file's cache has, and a live process that holds a partial build's lock as a builder does."""

import subprocess
import sys
from pathlib import Path

from dataset import load_tokenizer
from dataset.cache import TOKENS_VERSION
from dataset.cache.key import cache_key, file_digest


def partials(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.glob(".partial-*")) if cache_root.is_dir() else []


def cache_files(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.iterdir())}


def data_key(path, max_seq_len: int = 512) -> str:
    """The key of a data file's token cache with the shipped tokenizer (the TINY flags' --max_seq_len),
    computed here from the file's bytes."""
    return cache_key(file_digest(Path(path)), load_tokenizer(None), max_seq_len, TOKENS_VERSION)


def hold_lock(lock: Path, seconds: float) -> subprocess.Popen:
    """A live process that holds a partial build's lock (as a builder does) for ``seconds``."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.seek(0); f.truncate(); f.write('otherhost.4242'); f.flush(); print('locked', flush=True); "
            "time.sleep(float(sys.argv[2]))")
    lock.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", code, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process
