"""The ranks of a node get one token cache (dataset/cache/node.py), with real gloo processes: local
rank 0 builds while the others wait, also past the process group's timeout; every rank then sees
the same samples, or the same bad line's error."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as torch_mp

import dataset.cache.build as token_cache
import dataset.cache.node as node_build
import dataset.cache.waiting as waiting
from dataset import DataError, SFTDataset, load_tokenizer
from dataset.cache import build_or_reuse_on_node
from tests.helpers.chat_rows import chat_line, make_chat, write_lines, write_rows
from tests.helpers.trainer_launch import free_port


def _ddp_worker(rank: int, world_size: int, port: int, runs: list, out_dir: str) -> None:
    """One rank: load each of `runs` (data path, cache dir) under one gloo group, in order, and write
    what it saw (or its error) to out_dir, one result per run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    if rank != 0:
        def must_not_build(*args, **kwargs):
            raise AssertionError(f"rank {rank} built the cache")

        token_cache.build_cache = must_not_build
    results = []
    for data_path, cache_dir in runs:
        result = {"rank": rank}
        try:
            build_or_reuse_on_node(Path(data_path), load_tokenizer(None), 128, Path(cache_dir), "error", 1,
                                   local_rank=rank)
            ds = SFTDataset(data_path, load_tokenizer(None), 128, cache_dir=cache_dir)
            result["cache_path"] = str(ds.cache.path)
            result["input_ids"] = [ds[i]["input_ids"].tolist() for i in range(len(ds))]
            result["labels"] = [ds[i]["labels"].tolist() for i in range(len(ds))]
        except DataError as exc:
            result["error"] = str(exc)
        results.append(result)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
    torch.distributed.destroy_process_group()


def run_two_ranks(folder: Path, data_paths: list[Path], timeout: float = 180.0) -> list[list[dict]]:
    """Two spawned gloo ranks that load each of `data_paths` in turn (a token cache folder each): per
    data path, the results of rank 0 and rank 1."""
    out_dir = folder / "out"
    out_dir.mkdir()
    runs = [(str(path), str(folder / f"cache{index}")) for index, path in enumerate(data_paths)]
    args = (2, free_port(), runs, str(out_dir))
    context = torch_mp.start_processes(_ddp_worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {timeout} s (hang)")
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]
    return [list(pair) for pair in zip(*ranks)]


@pytest.fixture(scope="module")
def two_rank_loads(tmp_path_factory):
    """One pair of gloo ranks loads a good file (30 chats) and then a file whose 7th line has an unknown
    role, each into a cache folder of its own; rank 1 must never build. Returns the data paths and, per
    file, both ranks' results."""
    folder = tmp_path_factory.mktemp("node_build")
    good = write_lines(folder / "data.jsonl", [make_chat(i) for i in range(30)])
    rows = [make_chat(i) for i in range(10)]
    rows[6] = '{"conversations": [{"role": "robot", "content": "x"}]}'
    bad = write_lines(folder / "bad.jsonl", rows)
    good_ranks, bad_ranks = run_two_ranks(folder, [good, bad])
    return {"good": (good, good_ranks), "bad": (bad, bad_ranks)}


@pytest.mark.slow
def test_ddp_rank0_builds_and_both_ranks_see_same_data(two_rank_loads):
    _, (rank0, rank1) = two_rank_loads["good"]
    assert "error" not in rank0 and "error" not in rank1
    assert rank0["cache_path"] == rank1["cache_path"]
    assert len(rank0["input_ids"]) == 30
    assert rank0["input_ids"] == rank1["input_ids"] and rank0["labels"] == rank1["labels"]


@pytest.mark.slow
def test_ddp_bad_line_raises_on_both_ranks(two_rank_loads):
    data_path, ranks = two_rank_loads["bad"]
    for result in ranks:
        assert result.get("error", "").startswith(f"{data_path}:7: ")
        assert "unknown role 'robot'" in result["error"]


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
            node_build.build_or_reuse_on_node(Path(data_path), load_tokenizer(None), 64, Path(cache_dir), "error", 1,
                                              local_rank=rank)
            ds = SFTDataset(data_path, load_tokenizer(None), 64, cache_dir=cache_dir)
            result["cache_path"] = str(ds.cache.path)
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
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)  # rank 1 does not time out in gloo while rank 0 builds
    assert rank0 == rank1 and len(rank0["input_ids"]) == 12
    assert "rank 1: waiting for local rank 0 to build the token cache" in (out_dir / "stderr1.txt").read_text()
    assert "waiting" not in (out_dir / "stdout1.txt").read_text()  # cache progress lines go to stderr
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == [".digests"]
