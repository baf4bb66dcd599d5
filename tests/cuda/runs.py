"""Whole trainer and script runs on the GPU: the tests that start processes or run a script's main, which
.ci/gpu_check's `slow` selection names (collected by tests/test_cuda.py)."""

import json

import pytest
import torch

from tests.helpers.trainer_launch import final_weights, flags, run_trainer, torchrun_cmd, train_losses
from trainer.runtime.datasheets import datasheet_for


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_gpu_trains_with_autocast_and_grad_scaler(data, tmp_path, dtype):
    args = flags(data, tmp_path, "--batch_size", "8", "--max_steps", "4", "--dtype", dtype, "--device", "cuda")
    result = run_trainer(args)
    assert "device cuda:0" in result.stdout
    losses = train_losses(tmp_path)
    assert losses[4] < losses[1]
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path).values())
    # the log window's model FLOPs/s, peak memory and, on a GPU of the datasheet table, MFU
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    assert train and all(row["model_tflops_per_s"] > 0 and row["max_memory_gib"] > 0 for row in train)
    in_table = datasheet_for(torch.cuda.get_device_name()) is not None
    assert all(("mfu" in row) == in_table and 0 < row.get("mfu", 0.5) < 1 for row in train)
    assert " GiB | eta " in result.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_nccl_equal_one_gpu_with_double_batch(data, tmp_path):
    common = ["--max_steps", "3", "--dtype", "float32", "--save_interval", "0"]
    run_trainer(flags(data, tmp_path / "two", "--batch_size", "4", "--backend", "nccl", *common), nproc=2, launcher=torchrun_cmd(2))
    run_trainer(flags(data, tmp_path / "one", "--batch_size", "8", *common))
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-4), key


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_two_gloo_ranks_on_one_gpu_equal_one_process_with_double_batch(data, tmp_path, dtype, atol):
    """DDP over gloo with both ranks on cuda:0 (NCCL refuses two ranks on one GPU), two micro-batches
    each (no_sync on the first): the weights of 1 process x 2B, within the dtype's rounding."""
    common = ["--max_steps", "3", "--dtype", dtype, "--save_interval", "0", "--device", "cuda:0",
              "--accumulation_steps", "2"]
    run_trainer(flags(data, tmp_path / "two", "--batch_size", "2", "--backend", "gloo", *common), nproc=2, launcher=torchrun_cmd(2))
    run_trainer(flags(data, tmp_path / "one", "--batch_size", "4", *common))
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for key in one:
        assert torch.allclose(one[key], two[key], atol=atol), key


def test_a_step_out_of_gpu_memory_is_one_line_naming_the_flags(data, tmp_path):
    """GPU 0 capped at 16 MiB (tests/helpers/faults.py): the tiny model fits, a step's LM-loss chunk
    (4,096 tokens x 6,400 logits) does not: the caching allocator's OutOfMemoryError, in one line."""
    import os

    from tests.helpers.trainer_launch import REPO, clean_env

    faulty = os.path.join(REPO, "tests", "helpers", "faults.py")
    result = run_trainer(flags(data, tmp_path, "--batch_size", "8", "--max_steps", "2", "--device", "cuda"),
                         script=faulty, env=clean_env(MINISFT_FAULT_GPU_MEMORY_MIB="16"), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1 ran out of memory on cuda:0 (CUDA out of memory.") and last.endswith(
        "lower --batch_size (raise --accumulation_steps to keep the batch per step), lower --max_seq_len, or give "
        "--gradient_checkpointing 1")


def test_bench_memory_measures_on_the_gpu():
    """scripts/bench_memory.py --device cuda on one GPU: the held bytes are exact, and the
    allocator's peak over the step holds at least them (plus the activations)."""
    from model import MiniMindConfig, MiniMindForCausalLM
    from scripts.bench_memory import run
    from tests.scripts.test_bench_memory import TINY

    with torch.device("meta"):
        parameters = list(MiniMindForCausalLM(MiniMindConfig(**TINY)).parameters())
    numel = sum(p.numel() for p in parameters)
    total, _, computed, measured, peak = run(1, False, TINY, "cuda")
    assert (total, computed, measured) == (numel, 4 * numel * 4, 4 * numel * 4 + len(parameters) * 4)
    assert peak >= measured


def test_the_roofline_join_places_nearly_all_gpu_time_against_an_estimate(data, capsys):
    """scripts/profile_step.py --roofline 1 on a small packed step: the ops whose GPU time finds no
    traced op ("-" rows) hold under 5% of it, and no traced op's ratio is below 0.5 (time joined to
    the wrong op would show there)."""
    from scripts import profile_step

    assert profile_step.main(["--hidden_size", "128", "--num_hidden_layers", "2", "--max_seq_len", "512",
                              "--batch_size", "4", "--mode", "packed", "--steps", "2", "--roofline", "1", "--top", "200",
                              "--data_path", str(data / "train.jsonl"), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    table = out.split("ops by their own GPU time against the step's roofline estimate, ms per step:\n")[1]
    rows = [line.split() for line in table.splitlines()[1:] if line.startswith("  ") and len(line.split()) >= 4]
    total = float(rows[-1][0])
    unjoined = sum(float(row[0]) for row in rows[:-1] if row[1] == "-")
    assert unjoined < 0.05 * total, table
    assert all(float(row[3]) >= 0.5 for row in rows[:-1] if row[1] != "-"), table
