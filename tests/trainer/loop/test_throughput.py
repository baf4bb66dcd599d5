"""trainer/loop/throughput.py and the log line: tokens/s, model FLOPs per second per process, and on a
GPU MFU against its datasheet peak and the allocator's peak memory of the window."""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.trainer.loop.test_loop_syncs import micro_batches, tiny_run
from trainer.loop.loop import agree_on_step
from trainer.loop.throughput import Throughput
from trainer.run_logger import RunLogger


def test_a_cpu_window_gives_tokens_and_model_flops_per_second_and_starts_the_next_one_empty():
    throughput = Throughput(torch.device("cpu"), torch.bfloat16, world_size=2)
    throughput.add(real_tokens=300, flops=6 * 10**12)
    throughput.add(real_tokens=100, flops=2 * 10**12)
    assert throughput.figures(elapsed=2.0, steps=2) == {"tokens_per_s": 200.0, "model_tflops_per_s": 2.0}  # 8 TFLOP / 2 processes / 2 s
    assert throughput.figures(elapsed=1.0, steps=0) == {"tokens_per_s": 0.0, "model_tflops_per_s": 0.0}


def test_a_gpu_window_adds_mfu_against_the_datasheet_and_the_peak_memory_then_resets_it(monkeypatch):
    allocated, resets = [3 * 2**30], []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    cuda = torch.device("cuda", 0)
    throughput = Throughput(cuda, torch.bfloat16, world_size=4)
    assert resets == [cuda]  # the first window's peak is of its steps, not of the model's loading
    throughput.add(real_tokens=1000, flops=int(4 * 494.7e12))  # per process 494.7 TFLOP in 2 s: a quarter of 989.4
    assert throughput.figures(elapsed=2.0, steps=1) == pytest.approx(
        {"tokens_per_s": 500.0, "model_tflops_per_s": 247.35, "mfu": 0.25, "max_memory_gib": 3.0})
    assert resets == [cuda, cuda]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B300")  # no datasheet
    assert "mfu" not in Throughput(cuda, torch.bfloat16, world_size=1).figures(elapsed=1.0, steps=1)


def test_the_first_step_is_left_out_of_a_window_with_later_steps_and_of_every_eta_after_it():
    throughput = Throughput(torch.device("cpu"), torch.float32, world_size=1)
    throughput.add(real_tokens=10, flops=10**12)
    throughput.first_step_done(seconds=100.0)  # loader start, compilation
    throughput.add(real_tokens=30, flops=3 * 10**12)
    throughput.add(real_tokens=30, flops=3 * 10**12)
    assert throughput.seconds_per_step(106.0, steps=3) == 3.0  # (106 - 100) / 2
    assert throughput.figures(elapsed=106.0, steps=3) == {
        "tokens_per_s": 10.0, "model_tflops_per_s": 1.0, "first_step_s": 100.0}
    throughput.add(real_tokens=30, flops=3 * 10**12)
    assert throughput.figures(elapsed=3.0, steps=1) == {"tokens_per_s": 10.0, "model_tflops_per_s": 1.0}
    assert throughput.seconds_per_step(109.0, steps=4) == 3.0


def test_a_window_of_the_first_step_alone_keeps_it_and_later_etas_still_leave_it_out():
    """--log_interval 1, or a stop right after the first step: that window's figures are of the first
    step, not of no work at all; the ETAs after it leave it out all the same."""
    throughput = Throughput(torch.device("cpu"), torch.float32, world_size=1)
    assert throughput.seconds_per_step(50.0, steps=1) == 50.0
    throughput.add(real_tokens=10, flops=10**12)
    throughput.first_step_done(seconds=100.0)
    assert throughput.seconds_per_step(100.0, steps=1) == 100.0
    assert throughput.figures(elapsed=100.0, steps=1) == {"tokens_per_s": 0.1, "model_tflops_per_s": 0.01}
    throughput.add(real_tokens=30, flops=3 * 10**12)
    assert throughput.figures(elapsed=3.0, steps=1) == {"tokens_per_s": 10.0, "model_tflops_per_s": 1.0}
    assert throughput.seconds_per_step(103.0, steps=2) == 3.0


def test_the_step_agreement_counts_the_model_flops_of_its_micro_batches():
    """Two micro-batches of rows 9 and 14 tokens (padded to 14) and 20 and 6 (padded to 20), their
    first third unlabelled: 68 computed tokens, 34 loss positions, 2 x 105 + 2 x 210 causal pairs."""
    run = tiny_run(torch.device("cpu"))  # body 123,264 parameters, hidden 64, vocabulary 97, 2 layers of 4 x 16
    totals = agree_on_step(run, micro_batches(0))
    assert (totals.loss_tokens, totals.real_tokens) == (34, 49)
    assert totals.flops == 6 * 123264 * 68 + 6 * 64 * 97 * 34 + 12 * 2 * 64 * 630 == 52525824


def test_the_log_line_shows_mfu_and_memory_where_the_window_has_them(tmp_path, capsys):
    logger = RunLogger(SimpleNamespace(save_dir=str(tmp_path), use_wandb=0), is_main=True)
    logger.use_bar = False
    figures = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 140630.0, "model_tflops_per_s": 191.9,
               "mfu": 0.194, "max_memory_gib": 17.16, "skipped_steps": 0}
    logger.log_train(10, 100, 0, 1, figures, eta_s=65)
    assert capsys.readouterr().out.splitlines() == [
        "step 10/100 (epoch 1/1) | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | 140,630 tok/s | mfu 19.4% | "
        "mem 17.2 GiB | eta 1m05s"]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (row["model_tflops_per_s"], row["mfu"], row["max_memory_gib"]) == (191.9, 0.194, 17.16)
    del figures["mfu"], figures["max_memory_gib"]  # a CPU's window
    logger.log_train(20, 100, 0, 1, figures, eta_s=65)
    assert capsys.readouterr().out.splitlines() == [
        "step 20/100 (epoch 1/1) | loss 2.5000 | lr 1.00e-03 | grad_norm 0.500 | 140,630 tok/s | eta 1m05s"]
