"""A token-cache build that survives being stopped (dataset/cache/resumable.py): a restart continues
after the rows the stopped build committed (after an error, a ``kill -9``, a full disk) and gives
the cache of an uninterrupted build; another file version's partial build is not reused, a live
builder's is not touched; a cache file that cannot be written is one line."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dataset.cache.build as token_cache
import dataset.cache.resumable as partial_build
import dataset.cache.waiting as waiting
from dataset import DataError, build_cache_and_open
from tests.helpers.cache_checks import cache_files, hold_lock, partials
from tests.helpers.chat_rows import chat_line, write_rows
from tests.helpers.private_tmpfs import can_mount_a_private_tmpfs
from tests.helpers.trainer_launch import REPO, SCRIPT, TINY, clean_env


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
    assert sum(encoded) == 23 - 15  # only the rows after the committed 15 are encoded, not all 23
    assert ("continuing cache build at row 15 of 23 (r.jsonl: the rows before were tokenized by an earlier run, "
            "which stopped: RuntimeError: injected failure)") in capsys.readouterr().err
    assert resumed.cache.path.name == whole.cache.path.name
    assert cache_files(resumed.cache.path) == cache_files(whole.cache.path)  # tokens, masks, offsets, meta
    assert partials(cache_root) == []


def test_a_restart_says_resuming_only_after_an_interrupted_build(tokenizer, tmp_path, monkeypatch, capsys):
    """A build stopped by a bad row (--bad_data error) was not interrupted: its restart in skip mode
    continues after the committed rows and says why the earlier run stopped. Only the restart of an
    interrupted build says "resuming ... interrupted run"; a SIGTERM is an interruption."""
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


def test_a_build_refused_after_its_last_row_is_refused_again_without_a_restart_line(tokenizer, tmp_path, monkeypatch,
                                                                                      capsys):
    """A build whose every row was tokenized but which had no usable sample (here: every reply cut
    off by max_seq_len) fails the same way when run again, with nothing left to tokenize: no
    "continuing cache build at row 6 of 6" line before the same error."""
    monkeypatch.setattr(partial_build, "COMMIT_S", 0.0)
    path = write_rows(tmp_path / "n.jsonl", [chat_line(i) for i in range(6)])
    refusal = f"^{path}: no usable samples \\(0 bad lines skipped, 6 samples without loss tokens after truncation to max_seq_len=4\\)$"
    for _ in range(2):
        capsys.readouterr()
        with pytest.raises(DataError, match=refusal):
            build_cache_and_open(path, tokenizer, 4, num_proc=1)
        assert "cache build at row" not in capsys.readouterr().err


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
    assert cache_files(changed.cache.path) == cache_files(fresh.cache.path)
    # The old version's partial build is removed; the other file's is kept for its own restart.
    assert len(other_partial) == 1 and partials(cache_root) == other_partial


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
    new_partial = cache_root / f".partial-{new.cache.path.name}"
    shutil.rmtree(new.cache.path)
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
    assert cache_files(resumed.cache.path) == cache_files(whole.cache.path)
    assert partials(cache_root) == []


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
    assert cache_files(resumed.cache.path) == cache_files(whole.cache.path)


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


def test_the_digest_of_the_samples_is_that_of_the_samples_however_they_are_chunked():
    ids, mask = np.arange(9, dtype=np.uint16), np.array([0, 1, 1, 0, 1, 0, 0, 1, 1], np.uint8)
    lengths = np.array([2, 3, 4])
    whole = partial_build.chain_samples("", ids, mask, lengths)
    cut = partial_build.chain_samples(partial_build.chain_samples("", ids[:2], mask[:2], lengths[:1]), ids[2:], mask[2:],
                                      lengths[1:])
    assert whole == cut == hashlib.sha256(
        hashlib.sha256(hashlib.sha256(ids[:2].tobytes() + mask[:2].tobytes()).hexdigest().encode()
                                           + ids[2:5].tobytes() + mask[2:5].tobytes()).hexdigest().encode()
        + ids[5:].tobytes() + mask[5:].tobytes()).hexdigest()
    assert partial_build.chain_samples("", ids, mask, np.array([3, 2, 4])) != whole  # other samples, same tokens
