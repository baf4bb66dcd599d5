"""The loop's host reads of device values (trainer/loop/loop.py, trainer/loop/health.py): none in a
step between log lines; the flags of skipped steps and the weights check read at log lines,
saves and evaluations, --max_bad_steps counted on the device.

`scripts/_host_reads.py` marks every tensor computed from the model, the loss or the optimizer,
and the model's inputs as the device's copies of the batch, and records each read of one on the
host (on a GPU, a wait for the device). The GPU version, with
torch.cuda.set_sync_debug_mode("error"), is in tests/test_cuda.py."""

import contextlib
import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

from dataset import SFTCollator
from model.flops import ModelFlops
from scripts._host_reads import HostReads
from tests.helpers.trainer_launch import REPO, clean_env, torchrun_cmd
from tests.helpers.tiny_model import tiny_model
from trainer.errors import TrainingError
from trainer.loop import loop
from trainer.loop.loop import evaluate_and_select, log_interval, save, settle, take_step
from trainer.loop.source_losses import SourceLosses
from trainer.loop.state import Run
from trainer.loop.throughput import Throughput
from trainer.model_setup import build_optimizer
from trainer.parallel.ddp import Replicated
from trainer.runtime.distributed import DistContext
from trainer.runtime.precision import build_grad_scaler


class Logger:
    def __init__(self):
        self.lines, self.rows = [], []

    def print(self, line):
        self.lines.append(line)

    def log_train(self, step, total_steps, epoch, epochs, figures, eta_s):
        self.rows.append((step, figures))


def tiny_run(device: torch.device, log_interval: int = 100, max_bad_steps: int = 100, parallel=None, ctx=None,
             dtype: torch.dtype = torch.float32, layers: int = 2, dropout: float = 0.0) -> Run:
    """A Run of a tiny fp32 model, trained under autocast to `dtype` (float32: none), with the pieces a
    step and a log line use."""
    model = tiny_model(num_hidden_layers=layers, dropout=dropout).to(device).train()
    ctx = ctx or DistContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)
    args = SimpleNamespace(grad_clip=1.0, learning_rate=1e-3, weight_decay=0.1, save_dir="out", epochs=1,
                           log_interval=log_interval, max_bad_steps=max_bad_steps)
    parallel = parallel or Replicated(ctx)
    wrapped = parallel.wrap(model)
    return Run(args, ctx, wrapped, build_optimizer(model, args, device), build_grad_scaler(device, dtype),
               dtype, data=SimpleNamespace(dataset=range(10**6)), eval_sets=[], tokenizer=None,
               logger=Logger(), preemption=SimpleNamespace(requested=False), parallel=parallel)


def micro_batches(seed: int = 0, kind: str = "padded") -> list[dict]:
    """Two micro-batches of unequal lengths (accumulation 2): padded rows of one document each,
    "packed" rows of several (their position ids restart at 0), or a "mixture" of two sources."""
    collate = SFTCollator(pad_token_id=0)
    generator = torch.Generator().manual_seed(seed)

    def item(documents, row):
        length = sum(documents)
        ids = torch.randint(1, 97, (length,), generator=generator)  # tiny_model: 97 tokens
        labels = ids.clone()
        labels[: length // 3] = -100
        item = {"input_ids": ids.numpy(), "labels": labels.numpy()}
        if kind == "packed":
            item["position_ids"] = torch.cat([torch.arange(n) for n in documents]).numpy()
        if kind == "mixture":
            item["source"] = row % 2
        return item

    rows = ([[5, 4], [3, 7, 4]], [[8, 12], [6]]) if kind == "packed" else ([[9], [14]], [[20], [6]])
    return [collate([item(documents, row) for row, documents in enumerate(batch)]) for batch in rows]


def new_interval(run: Run, sources: bool = False) -> dict:
    """A log window's record as the loop keeps it; with `sources`, the losses of two training sources."""
    return {"loss": torch.zeros((), device=run.ctx.device), "start": 0.0, "run_start": 0.0,
            "throughput": Throughput(run.ctx.device, run.dtype, run.ctx.world_size),
            "run_first_step": 0, "resumed_at": None,
            "sources": SourceLosses(["a", "b"], run.ctx.device) if sources else None}


def poisoned(run: Run):
    """The model's loss made NaN for the steps taken inside (a forward hook)."""
    def hook(module, inputs, out):
        out.loss = out.loss * float("nan")
        return out

    class Poison:
        def __enter__(self):
            self.handle = run.model.register_forward_hook(hook)

        def __exit__(self, *exc):
            self.handle.remove()

    return Poison()


def snapshot(run: Run) -> dict:
    state = {f"w.{name}": p.detach().clone() for name, p in run.raw_model.named_parameters()}
    for index, param in enumerate(run.raw_model.parameters()):
        for key, value in run.optimizer.state.get(param, {}).items():
            state[f"{key}.{index}"] = value.detach().clone()
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["padded", "packed", "mixture"])
def test_steps_between_log_lines_read_nothing_and_a_skipped_step_changes_nothing(kind, monkeypatch):
    """Padded rows, packed rows (the collator's layout) and a mixture of two sources (the per-source
    losses): the model's inputs are marked as the device's copies (a read of one waits on a GPU)."""
    run = tiny_run(torch.device("cpu"))
    interval = new_interval(run, sources=kind == "mixture")
    guard = HostReads(run.model, run.optimizer)
    monkeypatch.setattr(loop, "model_inputs", guard.on_the_device(loop.model_inputs))
    assert guard.during(lambda: take_step(run, micro_batches(0, kind), interval, 1e-3)) == []
    before = snapshot(run)
    with poisoned(run):
        assert guard.during(lambda: take_step(run, micro_batches(1, kind), interval, 1e-3)) == []
    assert_same(snapshot(run), before)  # weights, moments, step counters: as after step 1
    assert guard.during(lambda: take_step(run, micro_batches(2, kind), interval, 1e-3)) == []
    assert run.state.skipped_steps == 0 and len(run.health.pending) == 3  # nothing read yet
    assert int(run.optimizer.state[next(run.raw_model.parameters())]["step"]) == 2
    # the log line reads the flags (one skipped step), the weights check and the loss
    reads = guard.during(lambda: log_interval(run, interval, torch.zeros(()), 1e-3, 10))
    assert reads and all("trainer/" in read for read in reads), reads
    step, figures = run.logger.rows[-1]
    assert step == 3 and figures["skipped_steps"] == 1 and run.state.skipped_steps == 1
    assert run.logger.lines == ["warning: step 2 had a non-finite loss or gradient norm: optimizer step skipped "
                                "(1 in a row, 1 in total)"]
    # the loss is the mean of the two applied steps
    again = tiny_run(torch.device("cpu"))
    losses = [float(loop.optimizer_step(again, batches, loop.agree_on_step(again, batches), 1e-3).loss)
              for batches in (micro_batches(0, kind), micro_batches(2, kind))]
    assert figures["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    if kind == "mixture":  # the token-weighted per-source losses sum back to the loss
        parts = sum(figures[f"loss_share/{name}"] * figures[f"loss/{name}"] for name in ("a", "b"))
        assert parts == pytest.approx(figures["loss"], rel=1e-5)


def stop_record(run: Run) -> dict:
    """What a stop saves of the run (the resume checkpoint's parts that a step changes)."""
    state = run.state
    return {"position": (state.step, state.epoch, state.samples_in_epoch, state.skipped_steps, state.bad_steps_in_a_row),
            "lr": run.optimizer.param_groups[0]["lr"], "weights": snapshot(run), "generator": torch.get_rng_state(),
            "scaler": run.scaler.state_dict()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_max_bad_steps_stop_at_the_step_that_completes_them_as_a_run_that_reads_every_step(dtype, monkeypatch):
    """--log_interval 10, --max_bad_steps 3, dropout 0.1: steps 2-4 are bad and complete the streak at
    step 4; steps 5 and 6, finite, were queued before any read and change nothing (the device skips
    their updates). No step reads the device; the log line finds the streak, and the run stops at
    step 4 and saves exactly what a run that reads after every step saves: weights, AdamW's moments
    and step, position in the data, learning rate, dropout's generator, float16 loss scale."""
    lrs = {step: 1e-3 * step for step in range(1, 7)}

    def train(read_every_step: bool) -> tuple[list[dict], str, list]:
        run = tiny_run(torch.device("cpu"), log_interval=10, max_bad_steps=3, dtype=dtype, dropout=0.1)
        interval, saved, reads = new_interval(run), [], []
        monkeypatch.setattr(loop, "save", lambda run: saved.append(stop_record(run)))
        guard = HostReads(run.model, run.optimizer)
        with pytest.raises(TrainingError) as stopped:
            for step in range(1, 7):
                with poisoned(run) if step in (2, 3, 4) else contextlib.nullcontext():
                    reads.append(guard.during(lambda: take_step(run, micro_batches(step), interval, lrs[step])))
                if read_every_step:
                    settle(run)
                if step == 1 and dtype == torch.float16:
                    run.scaler.update(1.0)  # as after 16 overflowing steps: each overflow now counts as bad
            log_interval(run, interval, torch.zeros(()), lrs[6], 10)
        return saved, str(stopped.value), reads

    every_step, message, _ = train(read_every_step=True)
    at_the_log_line, same_message, reads = train(read_every_step=False)
    assert reads == [[]] * 6
    assert same_message == message == ("3 optimizer steps in a row had a non-finite loss or gradient norm (last at "
                                       "step 4); stopped. The last good weights are saved in out")
    assert len(at_the_log_line) == len(every_step) == 1
    saved, expected = at_the_log_line[0], every_step[0]
    assert saved["position"] == expected["position"] == (4, 0, 16, 3, 3)
    assert saved["lr"] == expected["lr"] == lrs[4]
    assert_same(saved["weights"], expected["weights"])
    assert torch.equal(saved["generator"], expected["generator"])
    assert saved["scaler"] == expected["scaler"]


def test_an_update_that_breaks_the_weights_stops_the_run_at_the_next_log_line_naming_it():
    run = tiny_run(torch.device("cpu"))
    interval = new_interval(run)
    guard = HostReads(run.model, run.optimizer)
    assert guard.during(lambda: take_step(run, micro_batches(0), interval, 1e-3)) == []
    log_interval(run, interval, torch.zeros(()), 1e-3, 10)  # step 1's weights: finite
    # step 2's update overflows the weights (finite gradients; as --learning_rate 1e20 --weight_decay 1e20)
    run.optimizer.param_groups[0]["weight_decay"] = 1e20
    assert guard.during(lambda: take_step(run, micro_batches(1), interval, 1e20)) == []
    run.optimizer.param_groups[0]["weight_decay"] = 0.1
    broken = snapshot(run)
    assert guard.during(lambda: take_step(run, micro_batches(2), interval, 1e-3)) == []  # NaN loss: skipped
    assert_same(snapshot(run), broken)
    with pytest.raises(TrainingError, match=r"^step 2 made the weights non-finite \(--learning_rate 0\.001 or "
                                            r"--weight_decay 0\.1 too large\?\); stopped without saving them"):
        log_interval(run, interval, torch.zeros(()), 1e-3, 10)
    assert [step for step, _ in run.logger.rows] == [1]  # step 3 logged nothing


@pytest.mark.parametrize("reader", [save, evaluate_and_select])
def test_a_save_or_an_evaluation_reads_the_pending_checks_before_anything_else(reader):
    run = tiny_run(torch.device("cpu"))
    interval = new_interval(run)
    take_step(run, micro_batches(0), interval, 1e-3)
    settle(run)  # finite: nothing happens
    assert run.health.pending == [] and run.health.applied_since_check == []
    run.optimizer.param_groups[0]["weight_decay"] = 1e20
    take_step(run, micro_batches(1), interval, 1e20)
    # the run has no data, logger or tokenizer: anything past the check would fail otherwise
    with pytest.raises(TrainingError, match="^step 2 made the weights non-finite"):
        reader(run)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_read_nothing_between_log_lines(parallel, tmp_path):
    """DDP and FSDP2 in two real gloo processes (tests/helpers/step_reads_check.py): three steps, one
    of them skipped, without a host read of a device value; the log line then reads. The window's
    model FLOPs are both ranks' micro-batches' (rank r takes micro_batches(r), (2 + r), (4 + r)), of
    the whole model under FSDP too, whose parameters each rank holds a shard of."""
    out = tmp_path / "reads.json"
    subprocess.run([*torchrun_cmd(2), os.path.join(REPO, "tests", "helpers", "step_reads_check.py"), parallel,
                    str(out)], cwd=REPO, env=clean_env(), check=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["steps"] == [[], [], []], report
    assert report["log_line"] and report["skipped_steps"] == 1 and report["unchanged_by_skipped_step"]
    flops = ModelFlops(tiny_model(num_hidden_layers=2))
    assert report["window_flops"] == sum(flops.of_batch(batch, int((batch["labels"][:, 1:] != -100).sum()))
                                         for seed in range(6) for batch in micro_batches(seed))
