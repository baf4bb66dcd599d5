"""Building a token cache (dataset/cache/build.py): its progress lines, a parallel build equal to the
serial one, and a build stopped by a signal or a killed worker (real signals to real processes)."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dataset.cache.build as token_cache
from dataset import DataError, build_cache_and_open
from tests.helpers.cache_checks import partials
from tests.helpers.chat_rows import chat_line, make_chat, write_lines, write_rows
from tests.helpers.trainer_launch import REPO, SCRIPT, TINY, clean_env


def test_build_prints_progress_with_rate_and_eta(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(token_cache, "PROGRESS_S", 0.0)
    build_cache_and_open(write_rows(tmp_path / "p.jsonl", [chat_line(i) for i in range(12)]), tokenizer, 64, num_proc=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing p.jsonl: ")]
    assert [line.split(": ")[1].split(" rows")[0] for line in lines] == ["5/12", "10/12", "12/12"]
    assert all(" rows/s, elapsed " in line and ", ETA " in line for line in lines)
    assert lines[-1].endswith("ETA 0 s")


def test_parallel_build_equals_serial_build(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 7)
    rows = [make_chat(i) for i in range(40)]
    rows[23] = '{"broken'
    path = write_lines(tmp_path / "data.jsonl", rows)
    serial = build_cache_and_open(path, tokenizer, 128, num_proc=1, cache_dir=tmp_path / "serial", bad_data="skip")
    parallel = build_cache_and_open(path, tokenizer, 128, num_proc=2, cache_dir=tmp_path / "parallel", bad_data="skip")
    assert len(parallel) == len(serial) == 39 and parallel.num_skipped == 1
    assert np.array_equal(np.asarray(parallel.tokens), np.asarray(serial.tokens))
    assert np.array_equal(np.asarray(parallel.loss_mask), np.asarray(serial.loss_mask))
    with pytest.raises(DataError, match=f"{path}:24: invalid JSON"):
        build_cache_and_open(path, tokenizer, 128, num_proc=2, cache_dir=tmp_path / "strict")


BIG_ROWS = 80_000  # long enough to tokenize that the signal lands mid-build on a fast machine


def wait_for_build_start(cache_root: Path, process: subprocess.Popen, timeout: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while not partials(cache_root):
        assert process.poll() is None, f"exited early: {process.communicate()}"
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    time.sleep(0.5)  # into the tokenizing, with the pool's workers running
    return partials(cache_root)


def start_building(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A trainer in its own process group, tokenizing BIG_ROWS rows with its pool running."""
    data = write_rows(tmp_path / "big.jsonl", [chat_line(i) for i in range(BIG_ROWS)])
    cache_root = tmp_path / "cache"
    process = subprocess.Popen(
        [sys.executable, SCRIPT, *TINY, "--data_path", str(data), "--cache_dir", str(cache_root),
         "--save_dir", str(tmp_path / "out")],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_for_build_start(cache_root, process)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process, cache_root


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_group_while_tokenizing_ends_the_trainer_promptly(tmp_path, signum):
    process, cache_root = start_building(tmp_path)
    try:
        os.killpg(process.pid, signum)
        sent = time.monotonic()
        _, stderr = process.communicate(timeout=60)  # a build that lost chunks does not wait for them forever
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 30
    assert process.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == (
        f"stopped: {name} while building the token cache: stopped; run the same command again to continue it "
        "(the rows tokenized so far are kept)")
    # What was tokenized is committed for the next run; no cache is in place yet.
    [partial] = partials(cache_root)
    assert sorted(p.name for p in cache_root.iterdir()) == [".digests", partial]
    progress = json.loads((cache_root / partial / "progress.json").read_text(encoding="utf-8"))
    assert progress["total_rows"] == BIG_ROWS and progress["rows"] < BIG_ROWS


@pytest.mark.slow
def test_a_worker_killed_during_the_build_is_a_one_line_error_and_the_rows_stay(tmp_path):
    """The kernel's out-of-memory killer takes one tokenizer worker: multiprocessing.Pool replaced
    it and waited forever for its lost chunk; now the run stops with one line, its rows kept."""
    process, cache_root = start_building(tmp_path)
    try:
        workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert workers, "no worker processes"
        os.kill(int(workers[0]), signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 2, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"error: a worker process of the token cache build (pid {workers[0]}) was killed by SIGKILL (out of memory?); "
        "run the same command again")
    [partial] = partials(cache_root)
    progress = json.loads((cache_root / partial / "progress.json").read_text(encoding="utf-8"))
    assert progress["total_rows"] == BIG_ROWS and progress["rows"] < BIG_ROWS


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_signal_while_the_pool_forks_is_not_lost(tmp_path):
    """A SIGTERM that lands while the pool forks its workers stops the build. The signal is sent
    from an at-fork hook, the place a loaded machine once hit by chance: before the fix its
    BuildInterrupted was raised inside the at-fork callbacks, where CPython drops exceptions, and
    the build went on to the end."""
    data = write_rows(tmp_path / "rows.jsonl", [chat_line(i) for i in range(200)])
    code = ("import os, signal, sys; import dataset.cache.build as t; from dataset import build_cache_and_open; "
            "t.CHUNK_LINES = 20; sent = []; "
            "os.register_at_fork(before=lambda: sent or sent.append(os.kill(os.getpid(), signal.SIGTERM))); "
            "build_cache_and_open(sys.argv[1], None, 64, cache_dir=sys.argv[2], num_proc=2); print('built')")
    result = subprocess.run([sys.executable, "-c", code, str(data), str(tmp_path / "cache")], cwd=REPO,
                            env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout == "", result.stdout
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("dataset.cache.build.BuildInterrupted: SIGTERM while building"), \
        result.stderr
    assert "Exception ignored" not in result.stderr
