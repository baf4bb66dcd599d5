"""What a token cache's folder holds (its partial builds, a finished cache's files), the key a data
file's cache has, what a best model's record names a held-out file by, a cache as code of rows
version 1 left it, and a live process that holds a partial build's lock as a builder does."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from dataset import build_cache_and_open, load_tokenizer
from dataset.cache.key import ROWS_VERSION, TOKENS_VERSION, cache_key, file_digest
from tests.helpers.chat_rows import write_lines


def partials(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.glob(".partial-*")) if cache_root.is_dir() else []


def cache_files(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.iterdir())}


def data_key(path, max_seq_len: int = 512) -> str:
    """The key of a data file's token cache with the shipped tokenizer (the TINY flags' --max_seq_len),
    computed here from the file's bytes."""
    return cache_key(file_digest(Path(path)), load_tokenizer(None), max_seq_len, TOKENS_VERSION, ROWS_VERSION)


def held_out_entry(path, samples: int, max_seq_len: int = 512) -> str:
    """What a best model's record says a held-out file of ``samples`` samples (shipped tokenizer, the TINY
    flags' --max_seq_len) is: its key without a rows version (that of rows version 1), computed here from
    the file's bytes, and its number of samples."""
    key = cache_key(file_digest(Path(path)), load_tokenizer(None), max_seq_len, TOKENS_VERSION, 1)
    return f"{key} of {samples} samples"


def plant_rows_1_cache(data: Path, rows_1_reading: list, cache_root: Path, max_seq_len: int = 512) -> Path:
    """The token cache of ``data`` (shipped tokenizer) as code of rows version 1 left it: at ``data``'s
    key of rows version 1 (the key without a rows version, as every cache of tokens version 4 had
    it), its ``meta.json`` recording no rows version, holding what those rules read in ``data``: the
    rows ``rows_1_reading`` (dicts or lines, as ``write_lines`` takes them; bad ones skipped)."""
    made_of = write_lines(data.with_name(f"{data.stem}.rows-1.jsonl"), rows_1_reading)
    tokenizer = load_tokenizer(None)
    built = build_cache_and_open(made_of, tokenizer, max_seq_len, bad_data="skip", num_proc=1, log=lambda line: None)
    target = Path(cache_root) / cache_key(file_digest(data), tokenizer, max_seq_len, TOKENS_VERSION, 1)
    shutil.copytree(built.cache.path, target)
    meta = json.loads((target / "meta.json").read_text(encoding="utf-8"))
    del meta["rows_version"]
    meta.update(data_file=str(data), data_digest=file_digest(data),
                first_bad_line=meta["first_bad_line"] and meta["first_bad_line"].replace(str(made_of), str(data)))
    (target / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return target


def hold_lock(lock: Path, seconds: float) -> subprocess.Popen:
    """A live process that holds a partial build's lock (as a builder does) for ``seconds``."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.seek(0); f.truncate(); f.write('otherhost.4242'); f.flush(); print('locked', flush=True); "
            "time.sleep(float(sys.argv[2]))")
    lock.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", code, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process
