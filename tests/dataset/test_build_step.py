"""The token cache is built by a step of its own (trainer/data_setup.build_token_caches, with
dataset.cache.build_or_reuse_on_node); a dataset only opens a finished cache, builds none and runs
no collective; local rank 0 builds with the cores of every rank of its node."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import dataset.cache.build as build
import dataset.sft_dataset as sft_dataset
from dataset import SFTDataset, build_cache_and_open, load_tokenizer
from dataset.cache import CacheNotBuilt
from tests.helpers.trainer_launch import TINY, free_port
from trainer.args import parse_args
from trainer.data_setup import build_eval_sets, build_token_caches, build_train_data

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(9)]


def write_rows(path: Path, rows: int = 9) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS[:rows]), encoding="utf-8")
    return path


def test_a_dataset_under_a_process_group_runs_no_collective(tmp_path, monkeypatch):
    data = write_rows(tmp_path / "d.jsonl")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for name in ("broadcast_object_list", "all_gather_object", "all_reduce", "barrier", "broadcast"):
            monkeypatch.setattr(dist, name, lambda *args, name=name, **kwargs: pytest.fail(f"{name} in a dataset"))
        ds = build_cache_and_open(data, load_tokenizer(None), 64, num_proc=1)
        assert len(ds) == 9 and ds[3]["input_ids"].tolist() == SFTDataset(data, None, 64)[3]["input_ids"].tolist()
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_a_dataset_without_a_finished_cache_raises_and_builds_nothing(tmp_path, monkeypatch):
    data = write_rows(tmp_path / "d.jsonl")
    tokenizer = load_tokenizer(None)
    monkeypatch.setattr(build, "build_cache", lambda *args, **kwargs: pytest.fail("a dataset built a cache"))
    with pytest.raises(CacheNotBuilt) as raised:
        SFTDataset(data, tokenizer, 64, cache_dir=tmp_path / "cache")
    target = build.cache_target(data, tokenizer, 64, tmp_path / "cache")[1]
    assert str(raised.value) == (
        f"{data}: its token cache {target} (this tokenizer, max_seq_len=64) is not built; a dataset only opens a "
        "finished cache: build it first with dataset.cache.build_or_reuse (the training script's step "
        "trainer/data_setup.build_token_caches), or open it with dataset.build_cache_and_open")
    assert not target.exists()


@pytest.mark.parametrize("version, recorded", [("tokens_version", 3), ("rows_version", 1)])
def test_a_cache_of_another_tokens_or_rows_version_is_not_opened(tmp_path, version, recorded):
    data = write_rows(tmp_path / "d.jsonl")
    path = build_cache_and_open(data, None, 64, num_proc=1).cache.path
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    (path / "meta.json").write_text(json.dumps({**meta, version: recorded}), encoding="utf-8")
    current = {"tokens_version": build.TOKENS_VERSION, "rows_version": build.ROWS_VERSION}[version]
    with pytest.raises(CacheNotBuilt, match=f"^{data}: its token cache {path} records {version.split('_')[0]} version "
                                            f"{recorded}, not this code's {current}; a dataset only opens a finished cache"):
        SFTDataset(data, None, 64)


def test_the_data_setup_step_builds_the_caches_that_the_datasets_then_only_open(tmp_path, monkeypatch):
    files = [write_rows(tmp_path / "a.jsonl"), str(write_rows(tmp_path / "b.jsonl", 5))]  # --eval_data_path gives str
    args = SimpleNamespace(max_seq_len=64, cache_dir=str(tmp_path / "cache"), bad_data="error")
    tokenizer = load_tokenizer(None)
    built, real_build = [], build.build_cache
    monkeypatch.setattr(build, "build_cache", lambda path, *rest, **kwargs: built.append(path.name) or
                        real_build(path, *rest, **kwargs))
    build_token_caches(files, args, tokenizer, 0)
    assert built == ["a.jsonl", "b.jsonl"] and len(list((tmp_path / "cache").glob("*/meta.json"))) == 2
    build_token_caches(files, args, tokenizer, 0)  # finished: reused
    assert built == ["a.jsonl", "b.jsonl"]
    monkeypatch.setattr(build, "build_cache", lambda *args, **kwargs: pytest.fail("a dataset built a cache"))
    assert [len(SFTDataset(path, tokenizer, 64, cache_dir=args.cache_dir)) for path in files] == [9, 5]


def test_the_training_data_setup_builds_each_file_s_cache_once_then_opens_it(tmp_path, monkeypatch):
    a, b = write_rows(tmp_path / "a.jsonl"), write_rows(tmp_path / "b.jsonl", 5)
    args = parse_args([*TINY, "--data_path", f"{a},{b}", "--eval_data_path", str(b),
                       "--cache_dir", str(tmp_path / "cache")])
    ctx = SimpleNamespace(world_size=1, rank=0, local_rank=0, device=torch.device("cpu"))
    tokenizer = load_tokenizer(None)
    built, opened = [], []
    real_build, real_open = build.build_cache, sft_dataset.open_finished
    monkeypatch.setattr(build, "build_cache", lambda path, *rest, **kwargs: built.append(path.name) or
                        real_build(path, *rest, **kwargs))
    monkeypatch.setattr(sft_dataset, "open_finished", lambda path, *rest: opened.append(path.name) or
                        real_open(path, *rest))
    assert len(build_train_data(args, tokenizer, ctx).dataset) == 14
    assert (built, opened) == (["a.jsonl", "b.jsonl"], ["a.jsonl", "b.jsonl"])
    assert len(build_eval_sets(args, tokenizer, ctx, 512)[0].loader.dataset) == 5
    assert (built, opened) == (["a.jsonl", "b.jsonl"], ["a.jsonl", "b.jsonl", "b.jsonl"])


CORES_CODE = """
import os, sys
from dataset import load_tokenizer
from dataset.cache.build import encode_here, start_pool, stop_encoding
os.sched_setaffinity(0, {0})  # this rank's own core, as --cpus-per-task binds it
pool = start_pool(load_tokenizer(None), 2, {0, 1})  # the cores of its node
pool.submit((1, [], 64)).get(), pool.submit((1, [], 64)).get()  # each worker has run its initializer
print(sorted(os.sched_getaffinity(0)), [sorted(os.sched_getaffinity(p.pid)) for p in pool._processes])
stop_encoding(pool)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_the_tokenizer_processes_of_a_bound_rank_run_on_the_node_s_cores():
    result = subprocess.run([sys.executable, "-c", CORES_CODE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[0] [[0, 1], [0, 1]]"
