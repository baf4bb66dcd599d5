"""Building the token cache: compressed inputs, interruptions (real signals to real processes)
and resuming a killed build from the rows it finished."""

import gzip
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dataset.cache.resumable as partial_build
import dataset.sources as sources
import dataset.cache.key as digests
import dataset.cache.node as node_build
import dataset.cache.build as token_cache
import dataset.cache.waiting as waiting
from dataset import DataError, SFTDataset, build_cache_and_open, load_tokenizer
from tests.helpers.trainer_launch import REPO, SCRIPT, TINY, clean_env


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


# ----------------------------------------------------------------------------- .jsonl.gz


def test_gzip_file_gives_the_same_cache_as_the_plain_file(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    lines = [chat_line(i) for i in range(23)]
    plain = build_cache_and_open(write_rows(tmp_path / "a.jsonl", lines), tokenizer, 64, num_proc=1)
    packed = build_cache_and_open(write_rows(tmp_path / "a.jsonl.gz", lines), tokenizer, 64, num_proc=2)
    assert len(packed) == 23
    for a, b in zip(cache_arrays(plain), cache_arrays(packed)):
        assert np.array_equal(a, b)


def test_gzip_bad_row_and_corrupt_gzip_are_one_line_errors(tokenizer, tmp_path):
    lines = [chat_line(i) for i in range(4)]
    lines[2] = '{"broken'
    path = write_rows(tmp_path / "b.jsonl.gz", lines)
    with pytest.raises(DataError, match=f"^{path}:3: invalid JSON"):
        build_cache_and_open(path, tokenizer, 64, num_proc=1)
    truncated = tmp_path / "c.jsonl.gz"
    truncated.write_bytes(gzip.compress(("\n".join(chat_line(i) for i in range(200)) + "\n").encode())[:300])
    with pytest.raises(DataError, match=f"^{truncated}: not a readable gzip file"):
        build_cache_and_open(truncated, tokenizer, 64, num_proc=1)


# ----------------------------------------------------------------------------- interruptions

BIG_ROWS = 80_000  # long enough to tokenize that the signal lands mid-build on a fast machine


def partials(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.glob(".partial-*")) if cache_root.is_dir() else []


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
        _, stderr = process.communicate(timeout=60)  # the old code waited forever for lost chunks
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


def cache_files(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.iterdir())}


ENCODE_CHUNK = token_cache.encode_here


def counting_encoder(monkeypatch, fail_at_chunk: int | None = None) -> list[int]:
    """Count the rows the build encodes (num_proc=1 encodes in this process); optionally fail at a chunk."""
    rows: list[int] = []
    real = ENCODE_CHUNK

    def encode(task):
        if fail_at_chunk is not None and len(rows) == fail_at_chunk:
            raise RuntimeError("injected failure")
        rows.append(len(task[1]))
        return real(task)

    monkeypatch.setattr(token_cache, "encode_here", encode)
    return rows


def mixed_rows(count: int) -> list[str]:
    """Good rows with two bad ones (3, 17), a blank one (9) and one without loss tokens at 64 tokens (12)."""
    lines = [chat_line(i) for i in range(count)]
    lines[2] = '{"broken'
    lines[8] = ""
    lines[11] = json.dumps({"conversations": [{"role": "user", "content": "long " * 200},
                                              {"role": "assistant", "content": "ok"}]})
    lines[16] = json.dumps({"conversations": [{"role": "robot", "content": "x"}]})
    return lines


def test_a_failed_build_resumes_after_its_finished_chunks_and_gives_the_same_cache(tokenizer, tmp_path, monkeypatch,
                                                                                    capsys):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(partial_build, "COMMIT_S", 0.0)
    path = write_rows(tmp_path / "r.jsonl", mixed_rows(23))
    whole = build_cache_and_open(path, tokenizer, 64, cache_dir=tmp_path / "whole", num_proc=1, bad_data="skip")
    assert (whole.num_skipped, whole.num_dropped, len(whole)) == (2, 1, 19)

    cache_root = tmp_path / "resumed"
    counting_encoder(monkeypatch, fail_at_chunk=3)
    with pytest.raises(RuntimeError, match="injected failure"):
        build_cache_and_open(path, tokenizer, 64, cache_dir=cache_root, num_proc=1, bad_data="skip")
    [partial] = partials(cache_root)
    progress = json.loads((cache_root / partial / "progress.json").read_text(encoding="utf-8"))
    assert (progress["rows"], progress["total_rows"], progress["num_skipped"]) == (15, 23, 1)
    for torn in (cache_root / partial / "cache" / "tokens.bin", cache_root / partial / "lengths.bin"):
        with open(torn, "ab") as f:  # what a process killed while writing a chunk leaves after its last commit
            f.write(b"\x07" * 11)
    capsys.readouterr()

    encoded = counting_encoder(monkeypatch)
    resumed = build_cache_and_open(path, tokenizer, 64, cache_dir=cache_root, num_proc=1, bad_data="skip")
    assert sum(encoded) == 23 - 15  # the old code encoded all 23 again
    assert ("continuing cache build at row 15 of 23 (r.jsonl: the rows before were tokenized by an earlier run, "
            "which stopped: RuntimeError: injected failure)") in capsys.readouterr().err
    assert resumed.cache_path.name == whole.cache_path.name
    assert cache_files(resumed.cache_path) == cache_files(whole.cache_path)  # tokens, masks, offsets, meta
    assert partials(cache_root) == []


def test_a_restart_says_resuming_only_after_an_interrupted_build(tokenizer, tmp_path, monkeypatch, capsys):
    """A build stopped by a bad row (--bad_data error) was not interrupted: its restart in skip mode
    continues after the committed rows and says why the earlier run stopped. The old code said
    "resuming ... interrupted run" for every restart. A SIGTERM is an interruption."""
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(partial_build, "COMMIT_S", 0.0)
    lines = [chat_line(i) for i in range(23)]
    lines[16] = '{"broken'
    path = write_rows(tmp_path / "s.jsonl", lines)
    with pytest.raises(DataError, match=f"^{path}:17: invalid JSON"):
        build_cache_and_open(path, tokenizer, 64, num_proc=1)
    capsys.readouterr()
    build_cache_and_open(path, tokenizer, 64, num_proc=1, bad_data="skip")
    [line] = [line for line in capsys.readouterr().err.splitlines() if "cache build at row" in line]
    assert line == (f"continuing cache build at row 15 of 23 (s.jsonl: the rows before were tokenized by an earlier "
                    f"run, which stopped: {path}:17: invalid JSON (Invalid control character at at column 9))"), line

    other = write_rows(tmp_path / "t.jsonl", [chat_line(i) for i in range(23)])
    real = ENCODE_CHUNK
    calls = []

    def interrupted_at_the_fourth_chunk(task):
        calls.append(task)
        if len(calls) == 4:
            raise token_cache.BuildInterrupted(signal.SIGTERM)
        return real(task)

    monkeypatch.setattr(token_cache, "encode_here", interrupted_at_the_fourth_chunk)
    with pytest.raises(token_cache.BuildInterrupted):
        build_cache_and_open(other, tokenizer, 64, num_proc=1)
    capsys.readouterr()
    build_cache_and_open(other, tokenizer, 64, num_proc=1)
    [line] = [line for line in capsys.readouterr().err.splitlines() if "cache build at row" in line]
    assert line == ("resuming cache build at row 15 of 23 (t.jsonl: the rows before were tokenized by an earlier run, "
                    "interrupted by SIGTERM)"), line


def test_a_partial_build_of_another_file_version_is_not_reused(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 4)
    monkeypatch.setattr(partial_build, "COMMIT_S", 0.0)
    path = write_rows(tmp_path / "v.jsonl", [chat_line(i) for i in range(20)])
    other = write_rows(tmp_path / "other.jsonl", [chat_line(i) for i in range(20)][::-1])
    counting_encoder(monkeypatch, fail_at_chunk=2)
    for data in (path, other):
        with pytest.raises(RuntimeError, match="injected failure"):
            build_cache_and_open(data, tokenizer, 64, num_proc=1)
    cache_root = tmp_path / ".cache"
    old_partials = partials(cache_root)
    assert len(old_partials) == 2
    other_partial = [name for name in old_partials
                     if json.loads((cache_root / name / "progress.json").read_text())["data_file"] == str(other.resolve())]

    write_rows(path, [chat_line(i + 100) for i in range(20)])  # a new version of the file
    encoded = counting_encoder(monkeypatch)
    changed = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert sum(encoded) == 20  # nothing of the old version's 8 rows was reused
    fresh = build_cache_and_open(path, tokenizer, 64, cache_dir=tmp_path / "fresh", num_proc=1)
    assert cache_files(changed.cache_path) == cache_files(fresh.cache_path)
    # The old version's partial build is removed; the other file's is kept for its own restart.
    assert len(other_partial) == 1 and partials(cache_root) == other_partial


def hold_lock(lock: Path, seconds: float) -> subprocess.Popen:
    """A live process that holds a partial build's lock (as a builder does) for ``seconds``."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.seek(0); f.truncate(); f.write('otherhost.4242'); f.flush(); print('locked', flush=True); "
            "time.sleep(float(sys.argv[2]))")
    lock.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", code, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_live_builders_partial_build_is_not_touched(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 4)
    monkeypatch.setattr(partial_build, "COMMIT_S", 0.0)
    monkeypatch.setattr(waiting, "WAIT_REPORT_S", 0.2)
    path = write_rows(tmp_path / "w.jsonl", [chat_line(i) for i in range(12)])
    cache_root = tmp_path / ".cache"
    counting_encoder(monkeypatch, fail_at_chunk=1)
    with pytest.raises(RuntimeError, match="injected failure"):
        build_cache_and_open(path, tokenizer, 64, num_proc=1)
    [old] = partials(cache_root)
    counting_encoder(monkeypatch)
    # An outdated partial build held by a live process stays...
    holder = hold_lock(cache_root / old / "lock", 60)
    try:
        write_rows(path, [chat_line(i + 50) for i in range(12)])
        new = build_cache_and_open(path, tokenizer, 64, num_proc=1)
        assert partials(cache_root) == [old]
    finally:
        holder.kill()
        holder.wait()
    # ...and a build of the same cache waits for the live builder, then does the work itself.
    new_partial = cache_root / f".partial-{new.cache_path.name}"
    shutil.rmtree(new.cache_path)
    holder = hold_lock(new_partial / "lock", 1.5)
    capsys.readouterr()
    rebuilt = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    holder.wait()
    assert "waiting for process otherhost.4242, which is building this token cache" in capsys.readouterr().err
    assert len(rebuilt) == 12 and partials(cache_root) == []  # the old version's is removed once its holder is gone


@pytest.mark.slow
def test_a_kill_9_build_resumes_from_its_committed_rows(tokenizer, tmp_path, monkeypatch, capsys):
    rows = 600
    data = write_rows(tmp_path / "k9.jsonl", [chat_line(i) for i in range(rows)])
    cache_root = tmp_path / "cache"
    code = ("import sys, time; import dataset.cache.build as t, dataset.cache.resumable as p; "
            "t.CHUNK_LINES = 20; p.COMMIT_S = 0.0; encode = t.encode_here; "
            "t.encode_here = lambda task: time.sleep(0.1) or encode(task); "
            "from dataset import build_cache_and_open; build_cache_and_open(sys.argv[1], None, 64, cache_dir=sys.argv[2], num_proc=1)")
    process = subprocess.Popen([sys.executable, "-c", code, str(data), str(cache_root)], cwd=REPO, env=clean_env(),
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            found = list(cache_root.glob(".partial-*/progress.json"))
            if found and json.loads(found[0].read_text(encoding="utf-8"))["rows"] >= 100:
                break
            assert process.poll() is None and time.monotonic() < deadline, "no progress was committed"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    committed = json.loads(found[0].read_text(encoding="utf-8"))["rows"]
    assert 100 <= committed < rows

    monkeypatch.setattr(token_cache, "CHUNK_LINES", 20)
    encoded = counting_encoder(monkeypatch)
    capsys.readouterr()
    resumed = build_cache_and_open(data, tokenizer, 64, cache_dir=cache_root, num_proc=1)
    assert sum(encoded) == rows - committed
    assert (f"resuming cache build at row {committed} of {rows} (k9.jsonl: the rows before were tokenized by an earlier "
            "run, interrupted before it could record how: killed, or its machine lost)") in capsys.readouterr().err
    whole = build_cache_and_open(data, tokenizer, 64, cache_dir=tmp_path / "whole", num_proc=1)
    assert cache_files(resumed.cache_path) == cache_files(whole.cache_path)
    assert partials(cache_root) == []


# ----------------------------------------------------------------------------- a full disk


def run_trainer_on(data: Path, cache_root: Path, save_dir: Path, prefix: tuple = (), preexec_fn=None):
    return subprocess.run([*prefix, sys.executable, SCRIPT, *TINY, "--data_path", str(data), "--cache_dir", str(cache_root),
                           "--save_dir", str(save_dir)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=preexec_fn)


def assert_one_line_write_error(result, cache_root: Path, cause: str) -> None:
    """Exit 2 and one line naming the cache file that could not be written and why (no traceback);
    the rows committed before stay for the next run."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    [partial] = partials(cache_root)
    assert last == (f"error: could not write the token cache {cache_root / partial / 'cache' / 'tokens.bin'}: {cause} "
                    "(the rows committed so far are kept for the next run)"), last


@pytest.mark.slow
def test_a_file_size_limit_while_building_the_token_cache_is_one_line(tokenizer, tmp_path, capsys):
    """RLIMIT_FSIZE below the size of tokens.bin: the write fails with EFBIG. Before: exit 1 and a
    traceback ending in a bare "OSError: [Errno 27] File too large" (no file named). The next run,
    with room, continues after the committed rows and says why the earlier one stopped."""
    import resource

    data = write_rows(tmp_path / "d.jsonl", [chat_line(i) for i in range(3000)])
    limit = 64 * 1024  # far above the lock, progress.json and the digest memo; tokens.bin is ~150 KB

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cache_root = tmp_path / "cache"
    result = run_trainer_on(data, cache_root, tmp_path / "out", preexec_fn=limit_file_size)
    assert_one_line_write_error(result, cache_root, "File too large")
    [partial] = partials(cache_root)
    committed = json.loads((cache_root / partial / "progress.json").read_text(encoding="utf-8"))
    assert committed["rows"] > 0 and committed["stopped"].startswith("could not write the token cache ")

    capsys.readouterr()
    resumed = build_cache_and_open(data, tokenizer, 512, cache_dir=cache_root, num_proc=1)
    assert (f"continuing cache build at row {committed['rows']:,} of 3,000 (d.jsonl: the rows before were tokenized "
            f"by an earlier run, which stopped: could not write the token cache ") in capsys.readouterr().err
    whole = build_cache_and_open(data, tokenizer, 512, cache_dir=tmp_path / "whole", num_proc=1)
    assert cache_files(resumed.cache_path) == cache_files(whole.cache_path)


def can_mount_a_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or not can_mount_a_private_tmpfs(),
                    reason="needs unshare -Urm and a tmpfs mount in a private namespace")
def test_a_full_disk_while_building_the_token_cache_is_one_line(tmp_path):
    """--cache_dir on a 128 KiB tmpfs (mounted in a private user and mount namespace: nothing is left
    mounted): ENOSPC. Before: three chained tracebacks, the write's, then the final commit's and the
    close's (each flushing the same buffered bytes again)."""
    data = write_rows(tmp_path / "d.jsonl", [chat_line(i) for i in range(3000)])
    cache_root = tmp_path / "small_disk"
    cache_root.mkdir()
    mount = ("sh", "-c", 'mount -t tmpfs -o size=128k tmpfs "$0" && exec "$@"', str(cache_root))
    result = run_trainer_on(data, cache_root, tmp_path / "out", prefix=("unshare", "-Urm", *mount))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "During handling" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write the token cache {cache_root}/.partial-") and last.endswith(
        ": No space left on device (the rows committed so far are kept for the next run)"), last


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
    waiting.WAIT_REPORT_S = 1.0
    result = {}
    with (open(Path(out_dir, f"stdout{rank}.txt"), "w") as out, contextlib.redirect_stdout(out),
          open(Path(out_dir, f"stderr{rank}.txt"), "w") as err, contextlib.redirect_stderr(err)):
        try:
            node_build.build_or_reuse_on_node(Path(data_path), load_tokenizer(None), 64, Path(cache_dir), "error", 1)
            ds = SFTDataset(data_path, load_tokenizer(None), 64, cache_dir=cache_dir)
            result["cache_path"] = str(ds.cache_path)
            result["input_ids"] = [ds[i]["input_ids"].tolist() for i in range(len(ds))]
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["error"] = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_a_build_longer_than_the_process_group_timeout(tmp_path):
    import torch.multiprocessing as torch_mp

    from tests.helpers.trainer_launch import free_port

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
    assert "rank 1: waiting for local rank 0 to build the token cache" in (out_dir / "stderr1.txt").read_text()
    assert "waiting" not in (out_dir / "stdout1.txt").read_text()  # cache progress lines go to stderr
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == [".digests"]


def test_build_prints_progress_with_rate_and_eta(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(token_cache, "PROGRESS_S", 0.0)
    build_cache_and_open(write_rows(tmp_path / "p.jsonl", [chat_line(i) for i in range(12)]), tokenizer, 64, num_proc=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing p.jsonl: ")]
    assert [line.split(": ")[1].split(" rows")[0] for line in lines] == ["5/12", "10/12", "12/12"]
    assert all(" rows/s, elapsed " in line and ", ETA " in line for line in lines)
    assert lines[-1].endswith("ETA 0 s")


def test_unchanged_file_is_found_without_hashing_it_and_a_changed_one_is_rehashed(tokenizer, tmp_path, monkeypatch):
    path = write_rows(tmp_path / "k.jsonl", [chat_line(i) for i in range(6)])
    first = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    hashed = []
    real_digest = digests.file_digest
    monkeypatch.setattr(digests, "file_digest", lambda p: hashed.append(p) or real_digest(p))
    assert build_cache_and_open(path, tokenizer, 64, num_proc=1).cache_path == first.cache_path
    assert hashed == []  # the old code read the whole file at every start
    stat = path.stat()
    changed = path.read_bytes().replace(b"What is 0", b"What is 9", 1)  # same size; mtime restored below
    path.write_bytes(changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert hashed == [path] and second.cache_path != first.cache_path
    assert digests.data_digest(path, path.parent / ".cache") == real_digest(path)


def test_a_same_size_edit_between_the_sampled_blocks_with_the_mtime_kept_is_noticed(tokenizer, tmp_path):
    """What `rsync -a`, `cp -p` or `touch -r` leave: other bytes, the same size and mtime. The edit lies
    between two of the cheap key's sampled blocks of a file over 1 MiB; the old key (size, mtime,
    sampled blocks) took the file for the old one and reused the stale cache and digest."""
    path = write_rows(tmp_path / "big.jsonl", [chat_line(i) for i in range(14_000)])
    size = path.stat().st_size
    assert size > 1.2 * digests.SAMPLED_BLOCKS * digests.SAMPLED_BLOCK_BYTES  # gaps between the blocks
    first = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    old_digest = digests.data_digest(path, path.parent / ".cache")
    stat = path.stat()
    gap_start = size // digests.SAMPLED_BLOCKS + digests.SAMPLED_BLOCK_BYTES  # after block 1, before block 2
    data = bytearray(path.read_bytes())
    at = data.index(b"plus 1?", gap_start) - 2  # the last digit of "What is N plus 1?"
    assert gap_start < at < 2 * size // digests.SAMPLED_BLOCKS
    data[at] = ord("7") if data[at] != ord("7") else ord("3")
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert digests.data_digest(path, path.parent / ".cache") == digests.file_digest(path) != old_digest
    second = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert second.cache_path != first.cache_path


# ----------------------------------------------------------------------------- one huge line


def test_a_long_text_gives_the_tokens_of_the_whole_text(tokenizer, monkeypatch):
    """A sample cut to max_seq_len tokens is tokenized from a prefix of its text (dataset/prefix_tokens.py),
    not to its end, and gets the tokens and loss mask that tokenizing the whole text gives."""
    import dataset.prefix_tokens as prefix_tokens
    from dataset.formats import Conversation
    from dataset.tokens import encode_conversation

    texts = {
        "english": " ".join(f"word{i} and the fox jumped over {i * 7} dogs." for i in range(3000)),
        "chinese without spaces": "从前有一座山山里有一座庙庙里有一个老和尚在给小和尚讲故事" * 800,
        "digits": "3141592653589793238462643383279502884197" * 600,
        "whitespace runs": ("a  \n\n\t   b " * 4000),
        "one long word": "x" * 60_000,
        "special-token text in the data": "say <|im_end|> and <|im_start|>assistant\n then go on " * 2000,
    }
    seen: list[int] = []
    real = prefix_tokens._encode
    monkeypatch.setattr(prefix_tokens, "_encode", lambda tok, text, **kw: seen.append(len(text)) or real(tok, text, **kw))
    for name, text in texts.items():
        for conversation in (Conversation([{"role": "user", "content": "Go on."}, {"role": "assistant", "content": text}]),
                             Conversation([{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}])):
            for max_seq_len in (1, 64, 512):
                seen.clear()
                ids, mask = encode_conversation(tokenizer, conversation, max_seq_len)
                assert max(seen, default=0) <= 4 * prefix_tokens.MIN_WINDOW_CHARS, (name, max_seq_len, seen)  # not the whole text
                full_ids, full_mask = encode_conversation(tokenizer, conversation, 10**9)
                assert len(full_ids) > 2 * max_seq_len
                assert np.array_equal(ids, full_ids[:max_seq_len]), (name, max_seq_len)
                assert np.array_equal(mask, full_mask[:max_seq_len]), (name, max_seq_len)


PEAK_RSS_CODE = """
import json, resource, sys
from pathlib import Path
import dataset.cache.key as digests
import dataset.cache.node as node_build
import dataset.cache.build as token_cache
from dataset import load_tokenizer
tokenizer = load_tokenizer(None)
rss = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
before = rss()
token_cache.build_or_reuse(Path(sys.argv[1]), tokenizer, 512, Path(sys.argv[2]), "error", 1)
print(json.dumps({"before_mib": before, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


@pytest.mark.slow
def test_one_20_mb_line_is_built_in_a_small_multiple_of_its_size(tmp_path):
    """One conversation whose reply is 20 MB, cut to 512 tokens: the build's peak RSS grows by about
    150 MiB (the parsed and rendered copies of the text). Before, the whole text was tokenized
    (8.2 million tokens as Python lists): 3.9 GiB more, and 35 s."""
    data = tmp_path / "huge.jsonl"
    reply = "The quick brown fox jumps over the lazy dog 12345. " * (20_000_000 // 51)
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "Tell me everything."},
                                                  {"role": "assistant", "content": reply}]}) + "\n", encoding="utf-8")
    assert data.stat().st_size > 20_000_000
    result = subprocess.run([sys.executable, "-c", PEAK_RSS_CODE, str(data), str(tmp_path / "cache")], cwd=REPO,
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["peak_mib"] - measured["before_mib"] < 600, measured


# ----------------------------------------------------------------------------- .parquet


def test_parquet_file_gives_the_same_cache_as_the_jsonl_file(tokenizer, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(token_cache, "CHUNK_LINES", 5)
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 4)
    lines = [chat_line(i) for i in range(13)]
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines]), tmp_path / "a.parquet")
    plain = build_cache_and_open(write_rows(tmp_path / "a.jsonl", lines), tokenizer, 64, num_proc=1)
    table = build_cache_and_open(tmp_path / "a.parquet", tokenizer, 64, num_proc=2)
    for a, b in zip(cache_arrays(plain), cache_arrays(table)):
        assert np.array_equal(a, b)
    rows = [json.loads(line) for line in lines]
    rows[6]["conversations"][0]["role"] = "robot"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad.parquet'}:7: .*unknown role 'robot'"):
        build_cache_and_open(tmp_path / "bad.parquet", tokenizer, 64, num_proc=1)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        build_cache_and_open(tmp_path / "junk.parquet", tokenizer, 64, num_proc=1)


def openai_tool_row(call_arguments: dict, tool_properties: dict, **extra) -> dict:
    """An OpenAI-format tool conversation: one call with ``call_arguments``, one tool with ``tool_properties``."""
    tool = {"type": "function", "function": {"name": "calc", "description": "Compute.",
                                             "parameters": {"type": "object", "properties": tool_properties}}}
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": call_arguments}}
    return {"tools": [tool], "messages": [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "tool_calls": [call], **extra},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "42."},
    ]}


def parsed_rows(path: Path) -> list:
    from dataset.formats import parse_line

    return [parse_line(line.decode("utf-8")) for line in sources.open_lines(path)]


def test_parquet_structs_give_the_same_conversations_and_tokens_as_jsonl(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"system": "Be brief.", **openai_tool_row({"country": "Zorlia"}, {"country": {"type": "string"}})},
        openai_tool_row({"a": 2, "op": "+", "b": 3}, {"a": {"type": "integer"}, "op": {"type": "string"},
                                                      "b": {"type": "integer"}}, reasoning_content="Add."),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ]  # (from_pylist takes the columns from the first row's keys, the struct fields from all rows)
    jsonl = write_rows(tmp_path / "tools.jsonl", [json.dumps(row) for row in rows])
    table = pa.Table.from_pylist(rows)  # structs with the union of the rows' keys, null where a row lacks one
    assert "op" in str(table.schema.field("messages").type)
    pq.write_table(table, tmp_path / "tools.parquet")
    assert parsed_rows(tmp_path / "tools.parquet") == parsed_rows(jsonl)
    plain = build_cache_and_open(jsonl, tokenizer, 512, num_proc=1)
    columns = build_cache_and_open(tmp_path / "tools.parquet", tokenizer, 512, num_proc=1)
    assert len(columns) == 3
    for a, b in zip(cache_arrays(plain), cache_arrays(columns)):
        assert np.array_equal(a, b)


def test_a_null_in_a_parquet_struct_is_an_absent_key_and_a_json_string_or_map_keeps_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(name: str, rows: list, schema=None) -> Path:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / name)
        return tmp_path / name

    def jsonl(name: str, rows: list) -> Path:
        return write_rows(tmp_path / name, [json.dumps(row) for row in rows])

    with_null = openai_tool_row({"city": "Velm", "unit": None}, {"city": {"type": "string"}})
    without = openai_tool_row({"city": "Velm"}, {"city": {"type": "string"}})
    # A struct: the null field is an absent key, as pyarrow's filler for keys other rows have is.
    assert parsed_rows(parquet("struct.parquet", [with_null])) == parsed_rows(jsonl("without.jsonl", [without]))
    # Arguments as a JSON string keep the null the data wrote.
    as_string = openai_tool_row(json.dumps({"city": "Velm", "unit": None}), {"city": {"type": "string"}})
    kept = parsed_rows(parquet("string.parquet", [as_string]))
    assert kept == parsed_rows(jsonl("with.jsonl", [with_null]))
    assert kept[0].messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Velm", "unit": None}
    # So does a map column: its keys are the row's own.
    function = pa.struct([("name", pa.string()), ("arguments", pa.map_(pa.string(), pa.string()))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()),
                         ("tool_calls", pa.list_(pa.struct([("type", pa.string()), ("function", function)])))])
    schema = pa.schema([("messages", pa.list_(message))])
    mapped = {"messages": [{"role": "user", "content": "Go."}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"city": "Velm", "unit": None}}}]}]}
    assert parsed_rows(parquet("map.parquet", [mapped], schema)) == parsed_rows(jsonl("map.jsonl", [mapped]))


def test_parquet_columns_the_trainer_does_not_read_do_not_matter(tokenizer, tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(chat_line(i)) for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "plain.parquet")
    extra = pa.Table.from_pylist(rows).append_column(
        "created", pa.array([datetime.datetime(2024, 1, 1, i) for i in range(6)], pa.timestamp("us"))
    ).append_column("image", pa.array([bytes([i, 255]) for i in range(6)], pa.binary()))
    pq.write_table(extra, tmp_path / "extra.parquet")
    plain = build_cache_and_open(tmp_path / "plain.parquet", tokenizer, 64, num_proc=1)
    for bad_data in ("error", "skip"):
        wide = build_cache_and_open(tmp_path / "extra.parquet", tokenizer, 64, num_proc=1, bad_data=bad_data,
                          cache_dir=tmp_path / bad_data)
        assert wide.num_skipped == 0
        for a, b in zip(cache_arrays(plain), cache_arrays(wide)):
            assert np.array_equal(a, b)


def test_a_parquet_value_json_has_no_type_for_makes_its_row_bad(tokenizer, tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    cases = {
        "timestamp": ({"role": "user", "content": "Hi", "sent": datetime.datetime(2024, 1, 1)},
                      "parquet column conversations[].sent holds a timestamp[us] value, which JSON has no type for"),
        "binary": ({"role": "user", "content": "Hi", "image": b"\x89PNG"},
                   "parquet column conversations[].image holds a binary value"),
    }
    for name, (message, problem) in cases.items():
        rows = [json.loads(chat_line(i)) for i in range(3)]
        rows[1]["conversations"][0] = message
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        with pytest.raises(DataError) as caught:
            build_cache_and_open(path, tokenizer, 64, num_proc=1)
        assert str(caught.value).startswith(f"{path}:2: {problem}") and "\n" not in str(caught.value)
        skipped = build_cache_and_open(path, tokenizer, 64, num_proc=1, bad_data="skip", cache_dir=tmp_path / name)
        assert len(skipped) == 2 and skipped.num_skipped == 1
    # A NaN float (here in tool-call arguments) is not JSON either: that row's error, as in a jsonl line.
    rows = [openai_tool_row({"x": 1.5}, {"x": {"type": "number"}}), openai_tool_row({"x": float("nan")}, {})]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nan.parquet")
    with pytest.raises(DataError, match=r"nan\.parquet:2: invalid JSON \(NaN is not a JSON value\)"):
        build_cache_and_open(tmp_path / "nan.parquet", tokenizer, 512, num_proc=1)


def test_a_cache_built_by_the_parser_before_its_fixes_is_not_reused(tokenizer, tmp_path, monkeypatch):
    # Version 2 parsed '<think>' tags, NaN and parquet nulls otherwise: its caches hold other tokens.
    path = write_rows(tmp_path / "a.jsonl", [chat_line(i) for i in range(3)])
    with monkeypatch.context() as patch:
        patch.setattr(token_cache, "TOKENS_VERSION", 2)
        old = build_cache_and_open(path, tokenizer, 64, num_proc=1).cache_path
    built = []
    real_build = token_cache.build_cache
    monkeypatch.setattr(token_cache, "build_cache", lambda *args: built.append(args) or real_build(*args))
    assert build_cache_and_open(path, tokenizer, 64, num_proc=1).cache_path != old and built
