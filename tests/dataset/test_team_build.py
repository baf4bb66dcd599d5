"""The local ranks of a node build a token cache together (dataset/team_build.py, node_build.py):
real processes under gloo, each rank tokenizing its own chunks, local rank 0 appending them in
order. The cache is the one-process cache byte for byte, and a team killed mid-build resumes."""

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as torch_mp

from dataset import DataError, SFTDataset, load_tokenizer
from tests.helpers.trainer_launch import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "dataset" / "demo" / "sft_train.jsonl"
CACHE_FILES = ("tokens.bin", "loss_mask.bin", "offsets.npy", "meta.json")
pytestmark = pytest.mark.slow


def _team_worker(rank: int, world: int, port: int, data: str, cache_dir: str, out_dir: str, chunk_lines: int,
                 delay: float, failing_rank: int) -> None:
    """One rank: build (or continue) the cache with the node's other ranks; record the chunks this
    process tokenized (its first line numbers) and what it printed."""
    import torch.distributed as dist

    import dataset.cache.node as node_build
    import dataset.cache.resumable as partial_build
    import dataset.cache.build as token_cache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    token_cache.CHUNK_LINES = chunk_lines
    partial_build.COMMIT_S = 0.0
    real, encoded = token_cache.encode_here, []

    def recording(task):
        if rank == failing_rank and encoded:
            raise RuntimeError("a bug in a helper")
        encoded.append(task[0])
        time.sleep(delay)
        return real(task)

    token_cache.encode_here = node_build.encode_here = recording  # num_proc 1 per rank: tokenized in this process
    record = Path(out_dir, f"rank{rank}.json")
    with open(Path(out_dir, f"stderr{rank}.txt"), "w") as err, contextlib.redirect_stderr(err):
        try:
            node_build.build_or_reuse_on_node(Path(data), load_tokenizer(None), 1024, Path(cache_dir), "error", world)
            ds = SFTDataset(data, load_tokenizer(None), 1024, cache_dir=cache_dir, num_proc=world)
            record.write_text(json.dumps({"chunks": encoded, "cache": str(ds.cache_path), "samples": len(ds)}))
        except DataError as exc:
            record.write_text(json.dumps({"chunks": encoded, "error": str(exc)}))
    dist.destroy_process_group()


def start_team(tmp_path: Path, data: Path, world: int, out: str, chunk_lines: int, delay: float = 0.0,
               failing_rank: int = -1):
    out_dir = tmp_path / out
    out_dir.mkdir()
    args = (world, free_port(), str(data), str(tmp_path / "cache"), str(out_dir), chunk_lines, delay, failing_rank)
    return out_dir, torch_mp.start_processes(_team_worker, args=args, nprocs=world, join=False, start_method="spawn")


def finish(context, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {timeout} s (hang)")


def demo_rows(tmp_path: Path, count: int) -> Path:
    with open(DEMO, encoding="utf-8") as source:
        lines = [line for _, line in zip(range(count), source)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def one_process_cache(tmp_path: Path, data: Path) -> dict:
    ds = SFTDataset(data, load_tokenizer(None), 1024, cache_dir=tmp_path / "alone", num_proc=1)
    return {name: (ds.cache_path / name).read_bytes() for name in CACHE_FILES}


def test_three_ranks_tokenize_disjoint_chunks_into_the_one_process_cache(tmp_path):
    data = demo_rows(tmp_path, 1200)
    out_dir, context = start_team(tmp_path, data, world=3, out="team", chunk_lines=100)
    finish(context)
    records = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(3)]
    chunks = [record["chunks"] for record in records]
    assert all(chunks), chunks  # every rank tokenized (the old build: rank 0 alone)
    assert sorted(sum(chunks, [])) == list(range(1, 1201, 100))  # each chunk once
    assert chunks[1] == [101, 401, 701, 1001] and chunks[2] == [201, 501, 801, 1101]  # chunk c: rank c % 3
    assert len({record["cache"] for record in records}) == 1 and records[0]["samples"] == 1200
    cache = Path(records[0]["cache"])
    assert {name: (cache / name).read_bytes() for name in CACHE_FILES} == one_process_cache(tmp_path, data)
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == [".digests", cache.name]  # no team files left
    out_dir, context = start_team(tmp_path, data, world=3, out="again", chunk_lines=100)  # the cache is there now
    finish(context)
    assert all(json.loads((out_dir / f"rank{rank}.json").read_text())["chunks"] == [] for rank in range(3))
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == [".digests", cache.name]


def test_a_team_killed_mid_build_resumes_to_the_same_bytes(tmp_path):
    data = demo_rows(tmp_path, 1600)
    out_dir, context = start_team(tmp_path, data, world=2, out="killed", chunk_lines=50, delay=0.3)
    cache_root = tmp_path / "cache"
    deadline = time.monotonic() + 120
    committed = 0
    while committed < 300 and time.monotonic() < deadline:  # some rows committed, far from all
        time.sleep(0.1)
        with contextlib.suppress(OSError, ValueError):
            [progress] = cache_root.glob(".partial-*/progress.json")
            committed = json.loads(progress.read_text())["rows"]
    assert 300 <= committed < 1200, committed
    for process in context.processes:
        os.kill(process.pid, signal.SIGKILL)
    for process in context.processes:
        process.join()
    assert list(cache_root.glob(".team-*"))  # a killed team leaves its directory (and maybe chunk files)
    committed = json.loads(next(cache_root.glob(".partial-*/progress.json")).read_text())["rows"]

    out_dir, context = start_team(tmp_path, data, world=2, out="resumed", chunk_lines=50)
    finish(context)
    records = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted(sum((record["chunks"] for record in records), [])) == list(range(committed + 1, 1601, 50))
    assert all(record["chunks"] for record in records)  # the resumed build is shared too
    assert ("resuming cache build at row " + f"{committed:,} of 1,600 (rows.jsonl: the rows before were tokenized by an "
            "earlier run, interrupted before it could record how: killed, or its machine lost)") in (
        out_dir / "stderr0.txt").read_text()
    cache = Path(records[0]["cache"])
    assert {name: (cache / name).read_bytes() for name in CACHE_FILES} == one_process_cache(tmp_path, data)
    assert not list(cache_root.glob(".team-*")) and not list(cache_root.glob(".partial-*"))


def test_a_bad_row_in_a_helper_s_chunk_stops_the_team_with_the_file_s_first_bad_row(tmp_path):
    data = demo_rows(tmp_path, 600)
    lines = data.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[250] = '{"conversations": [{"role": "robot", "content": "x"}]}\n'  # chunk 2 (rank 0's: 201-300)
    lines[130] = '{"broken\n'  # chunk 1: rank 1's; the first bad row of the file
    data.write_text("".join(lines), encoding="utf-8")
    out_dir, context = start_team(tmp_path, data, world=2, out="bad", chunk_lines=100)
    finish(context)
    records = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert record["error"].startswith(f"{data}:131: invalid JSON"), record
    progress = json.loads(next((tmp_path / "cache").glob(".partial-*/progress.json")).read_text())
    assert progress["rows"] == 100  # the rows before the bad chunk stay committed, as a lone build keeps them
    assert not list((tmp_path / "cache").glob(".team-*"))


def test_a_helper_that_fails_leaves_its_chunks_to_local_rank_0(tmp_path):
    data = demo_rows(tmp_path, 800)
    out_dir, context = start_team(tmp_path, data, world=2, out="failing", chunk_lines=100, failing_rank=1)
    finish(context)
    records = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert records[1]["chunks"] == [101]  # its second chunk raised
    assert sorted(records[0]["chunks"]) == [1, 201, 301, 401, 501, 601, 701]  # rank 0 took over 301, 501, 701
    assert "rank 1: helping to build the token cache failed (RuntimeError: a bug in a helper)" in (
        out_dir / "stderr1.txt").read_text()
    cache = Path(records[0]["cache"])
    assert {name: (cache / name).read_bytes() for name in CACHE_FILES} == one_process_cache(tmp_path, data)


def test_a_chunk_being_written_is_not_counted_as_waiting(tmp_path):
    """A helper's chunk file is written under a temporary name and renamed: `waiting()` (called by
    another process at any moment) counts only finished chunk files (it raised ValueError on the
    temporary '2.tmpPID.npz' name, seen in the loaded suite)."""
    from dataset.cache.team import Team

    team = Team(tmp_path, "n", 0, 2, 0)
    team.dir.mkdir(parents=True)
    (team.dir / "2.npz").write_bytes(b"done")
    (team.dir / "4.tmp123.npz").write_bytes(b"half")  # the name the writer used before
    (team.dir / ".6.npz.tmp123").write_bytes(b"half")  # the name it uses now
    assert team.waiting() == 1
