"""scripts/step_figures.py: the dispatch counter counts exactly, and the command prints the figures
of the trainer's optimizer step for any trainer flags (tiny model, in process)."""

import json
from pathlib import Path

import pytest
import torch

from scripts._dispatch_counts import DispatchCounter
from scripts.step_figures import main, with_trainer_defaults

DEMO = Path(__file__).resolve().parents[2] / "dataset" / "demo" / "sft_train.jsonl"
TINY = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--max_seq_len", "64"]


def test_counter_counts_computing_ops_and_casts_but_not_views():
    x = torch.ones(4, 6)
    with DispatchCounter() as counter:
        y = x.view(6, 4).t()  # two views
        z = (y * 2).to(torch.bfloat16).float()  # mul + two casts
        z.sum()
    assert counter.total == 4
    assert counter.casts == 2
    assert counter.dispatches == 6


def test_trainer_defaults_are_batch_4_bf16_unless_given():
    assert with_trainer_defaults(["--packing", "1"]) == ["--batch_size", "4", "--dtype", "bfloat16", "--packing", "1"]
    assert with_trainer_defaults(["--batch_size=2", "--dtype", "float32"]) == ["--batch_size=2", "--dtype", "float32"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("figures")
    with open(DEMO, encoding="utf-8") as source:
        (folder / "train.jsonl").write_text("".join(line for _, line in zip(range(48), source)), encoding="utf-8")
    return folder


def figures(capsys, data, *flags) -> dict:
    argv = [*TINY, "--data_path", str(data / "train.jsonl"), "--cache_dir", str(data / "cache"), "--json",
            "--steps", "2", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_prints_ops_casts_and_flops_of_every_counted_step(capsys, data):
    bf16 = figures(capsys, data)
    fp32 = figures(capsys, data, "--dtype", "float32")
    for result in (bf16, fp32):
        assert len(result["ops"]) == len(result["casts"]) == len(result["flops"]) == 2
        assert all(flops > 0 for flops in result["flops"])
        assert result["graph_breaks"] is None  # not compiled
    assert min(bf16["casts"]) > max(fp32["casts"])  # autocast casts; fp32 runs hardly any


def test_compiled_step_reports_graph_breaks_and_recompiles(capsys, data):
    result = figures(capsys, data, "--dtype", "float32", "--use_compile", "1", "--compile_backend", "eager")
    assert result["frames"] >= 1
    assert result["graph_breaks"] >= 0 and result["recompiles"] >= 0
