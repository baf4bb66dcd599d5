"""Building the token cache: compressed inputs, interruptions (real signals to real processes)
and the temporary directories a killed build leaves."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dataset.sources as sources
import dataset.token_cache as token_cache
from dataset import DataError, SFTDataset, load_tokenizer
from tests.trainer_launch import REPO, SCRIPT, TINY, clean_env


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def chat_line(i: int) -> str:
    return json.dumps({"conversations": [{"role": "user", "content": f"What is {i} plus 1?"},
                                         {"role": "assistant", "content": str(i + 1)}]})


def write_rows(path: Path, lines: list[str]) -> Path:
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def cache_arrays(ds: SFTDataset) -> list[np.ndarray]:
    return [np.asarray(ds.tokens), np.asarray(ds.loss_mask), ds.offsets]


def temporaries(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.glob(".tmp-*")) if cache_root.is_dir() else []


# ----------------------------------------------------------------------------- .jsonl.gz


def test_gzip_file_gives_the_same_cache_as_the_plain_file(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    lines = [chat_line(i) for i in range(23)]
    plain = SFTDataset(write_rows(tmp_path / "a.jsonl", lines), tokenizer, 64, num_proc=1)
    packed = SFTDataset(write_rows(tmp_path / "a.jsonl.gz", lines), tokenizer, 64, num_proc=2)
    assert len(packed) == 23
    for a, b in zip(cache_arrays(plain), cache_arrays(packed)):
        assert np.array_equal(a, b)


def test_gzip_bad_row_and_corrupt_gzip_are_one_line_errors(tokenizer, tmp_path):
    lines = [chat_line(i) for i in range(4)]
    lines[2] = '{"broken'
    path = write_rows(tmp_path / "b.jsonl.gz", lines)
    with pytest.raises(DataError, match=f"^{path}:3: invalid JSON"):
        SFTDataset(path, tokenizer, 64, num_proc=1)
    truncated = tmp_path / "c.jsonl.gz"
    truncated.write_bytes(gzip.compress(("\n".join(chat_line(i) for i in range(200)) + "\n").encode())[:300])
    with pytest.raises(DataError, match=f"^{truncated}: not a readable gzip file"):
        SFTDataset(truncated, tokenizer, 64, num_proc=1)


# ----------------------------------------------------------------------------- interruptions

BIG_ROWS = 80_000  # long enough to tokenize that the signal lands mid-build on a fast machine


def wait_for_build_start(cache_root: Path, process: subprocess.Popen, timeout: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while not temporaries(cache_root):
        assert process.poll() is None, f"exited early: {process.communicate()}"
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    time.sleep(0.5)  # into the tokenizing, with the pool's workers running
    return temporaries(cache_root)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_group_while_tokenizing_ends_the_trainer_promptly(tmp_path, signum):
    data = write_rows(tmp_path / "big.jsonl", [chat_line(i) for i in range(BIG_ROWS)])
    cache_root = tmp_path / "cache"
    process = subprocess.Popen(
        [sys.executable, SCRIPT, *TINY, "--data_path", str(data), "--cache_dir", str(cache_root),
         "--save_dir", str(tmp_path / "out")],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_for_build_start(cache_root, process)
        os.killpg(process.pid, signum)
        sent = time.monotonic()
        _, stderr = process.communicate(timeout=60)  # the old code waited forever for lost chunks
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 30
    assert process.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == (
        f"stopped: {name} while building the token cache: stopped; run the same command again to build it")
    assert temporaries(cache_root) == [] and [p.name for p in cache_root.iterdir()] == [".digests"]


@pytest.mark.slow
def test_a_killed_builds_temporary_directory_is_removed_by_the_next_build(tokenizer, tmp_path):
    data = write_rows(tmp_path / "big.jsonl", [chat_line(i) for i in range(BIG_ROWS)])
    cache_root = tmp_path / "cache"
    code = (f"from dataset import SFTDataset; SFTDataset({str(data)!r}, None, 64, cache_dir={str(cache_root)!r})")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=clean_env(), start_new_session=True)
    try:
        left = wait_for_build_start(cache_root, process)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert temporaries(cache_root) == left and len(left) == 1
    # Another live builder's directory (this process) is kept; the killed one's is removed.
    live = cache_root / f".tmp-{'0' * 24}-{token_cache._builder_id()}-abcdefgh"
    live.mkdir()
    small = write_rows(tmp_path / "small.jsonl", [chat_line(i) for i in range(5)])
    SFTDataset(small, tokenizer, 64, cache_dir=cache_root, num_proc=1)
    assert temporaries(cache_root) == [live.name]


# ----------------------------------------------------------------------------- no collective while building


def _slow_build_worker(rank: int, port: int, data_path: str, cache_dir: str, out_dir: str) -> None:
    """One gloo rank whose process group times out after 2 s; local rank 0 build takes 4 s."""
    import contextlib
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    real_build = token_cache.build_cache

    def slow_build(*args, **kwargs):
        time.sleep(4)
        real_build(*args, **kwargs)

    token_cache.build_cache = slow_build
    token_cache.WAIT_REPORT_S = 1.0
    result = {}
    with open(Path(out_dir, f"stdout{rank}.txt"), "w") as out, contextlib.redirect_stdout(out):
        try:
            ds = SFTDataset(data_path, load_tokenizer(None), 64, cache_dir=cache_dir, num_proc=1)
            result["cache_path"] = str(ds.cache_path)
            result["input_ids"] = [ds[i]["input_ids"].tolist() for i in range(len(ds))]
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["error"] = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_a_build_longer_than_the_process_group_timeout(tmp_path):
    import torch.multiprocessing as torch_mp

    from tests.trainer_launch import free_port

    data = write_rows(tmp_path / "d.jsonl", [chat_line(i) for i in range(12)])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = (free_port(), str(data), str(tmp_path / "cache"), str(out_dir))
    context = torch_mp.start_processes(_slow_build_worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the ranks did not finish (hang)")
    rank0, rank1 = (json.loads((out_dir / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2))
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)  # old code: gloo timeout on rank 1
    assert rank0 == rank1 and len(rank0["input_ids"]) == 12
    assert "rank 1: waiting for local rank 0 to build the token cache" in (out_dir / "stdout1.txt").read_text()
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == [".digests"]


def test_build_prints_progress_with_rate_and_eta(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(token_cache, "PROGRESS_S", 0.0)
    SFTDataset(write_rows(tmp_path / "p.jsonl", [chat_line(i) for i in range(12)]), tokenizer, 64, num_proc=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing p.jsonl: ")]
    assert [line.split(": ")[1].split(" rows")[0] for line in lines] == ["5/12", "10/12", "12/12"]
    assert all(" rows/s, elapsed " in line and ", ETA " in line for line in lines)
    assert lines[-1].endswith("ETA 0 s")


def test_unchanged_file_is_found_without_hashing_it_and_a_changed_one_is_rehashed(tokenizer, tmp_path, monkeypatch):
    path = write_rows(tmp_path / "k.jsonl", [chat_line(i) for i in range(6)])
    first = SFTDataset(path, tokenizer, 64, num_proc=1)
    hashed = []
    real_digest = token_cache.file_digest
    monkeypatch.setattr(token_cache, "file_digest", lambda p: hashed.append(p) or real_digest(p))
    assert SFTDataset(path, tokenizer, 64, num_proc=1).cache_path == first.cache_path
    assert hashed == []  # the old code read the whole file at every start
    stat = path.stat()
    changed = path.read_bytes().replace(b"What is 0", b"What is 9", 1)  # same size; mtime restored below
    path.write_bytes(changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = SFTDataset(path, tokenizer, 64, num_proc=1)
    assert hashed == [path] and second.cache_path != first.cache_path
    assert token_cache.data_digest(path, path.parent / ".cache") == real_digest(path)


# ----------------------------------------------------------------------------- .parquet


def test_parquet_file_gives_the_same_cache_as_the_jsonl_file(tokenizer, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 4)
    lines = [chat_line(i) for i in range(13)]
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines]), tmp_path / "a.parquet")
    plain = SFTDataset(write_rows(tmp_path / "a.jsonl", lines), tokenizer, 64, num_proc=1)
    table = SFTDataset(tmp_path / "a.parquet", tokenizer, 64, num_proc=2)
    for a, b in zip(cache_arrays(plain), cache_arrays(table)):
        assert np.array_equal(a, b)
    rows = [json.loads(line) for line in lines]
    rows[6]["conversations"][0]["role"] = "robot"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad.parquet'}:7: .*unknown role 'robot'"):
        SFTDataset(tmp_path / "bad.parquet", tokenizer, 64, num_proc=1)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        SFTDataset(tmp_path / "junk.parquet", tokenizer, 64, num_proc=1)
