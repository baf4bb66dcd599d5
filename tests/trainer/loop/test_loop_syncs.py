"""The optimizer step's host synchronisation (trainer/loop/loop.py): one read of device values per step,
which carries both the gradient-norm check and the previous update's finite-weights check.

On CPU a "host sync" is every place where our code turns a tensor into a Python value (.item(),
.tolist(), bool(), float(), int()): on a GPU each of those waits for the device. The GPU version
of this test, with torch.cuda.set_sync_debug_mode, is in tests/test_cuda.py."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from dataset import SFTCollator
from tests.model.test_model import tiny_model
from tests.helpers.trainer_launch import REPO
from trainer.runtime.distributed import DistContext
from trainer.errors import TrainingError
from trainer.loop.loop import agree_on_step, evaluate_and_select, optimizer_step, save, settle_weights_check
from trainer.loop.state import Run
from trainer.model_setup import build_optimizer
from trainer.runtime.precision import build_grad_scaler
from trainer.parallel.ddp import Replicated

OUR_CODE = tuple(os.path.join(REPO, folder) + os.sep for folder in ("trainer", "model", "dataset"))
CONVERSIONS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def tiny_run(device: torch.device) -> Run:
    """A one-process Run of a tiny fp32 model (the pieces optimizer_step uses)."""
    model = tiny_model().to(device).train()
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)
    args = SimpleNamespace(grad_clip=1.0, learning_rate=1e-3, weight_decay=0.1, save_dir="out")
    parallel = Replicated(ctx)
    wrapped = parallel.wrap(model)
    return Run(args, ctx, wrapped, build_optimizer(model, args, device), build_grad_scaler(device, torch.float32),
               torch.float32, data=None, eval_sets=[], tokenizer=None, logger=None, preemption=SimpleNamespace(requested=False),
               parallel=parallel)


def micro_batches() -> list[dict]:
    """Two micro-batches of unequal lengths (accumulation 2)."""
    collate = SFTCollator(pad_token_id=0)
    generator = torch.Generator().manual_seed(0)

    def item(length):
        ids = torch.randint(1, 97, (length,), generator=generator)  # tiny_model: 97 tokens
        labels = ids.clone()
        labels[: length // 3] = -100
        return {"input_ids": ids.numpy(), "labels": labels.numpy()}

    return [collate([item(9), item(14)]), collate([item(20), item(6)])]


def step(run: Run, batches: list[dict], lr: float) -> bool:
    """One optimizer step as the loop takes it."""
    _, _, finite = optimizer_step(run, batches, agree_on_step(run, batches), lr)
    run.state.step += 1
    return finite


class ConversionCounter:
    """Counts the tensor-to-Python conversions that code in trainer/, model/ or dataset/ makes."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in CONVERSIONS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))

    def _counting(self, original, name):
        def convert(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(OUR_CODE):
                self.calls.append(f"{name} in {caller.co_name}")
            return original(tensor, *args, **kwargs)

        return convert

    def during(self, action):
        self.calls = []
        action()
        return self.calls


def test_an_optimizer_step_reads_the_device_once_and_that_read_catches_the_last_update_breaking_the_weights(monkeypatch):
    run = tiny_run(torch.device("cpu"))
    batches = micro_batches()
    counter = ConversionCounter(monkeypatch)
    # agree_on_step counts loss tokens on the CPU batches (host tensors, no device sync): outside the count
    totals = agree_on_step(run, batches)
    first = counter.during(lambda: optimizer_step(run, batches, totals, 1e-3))
    assert first == ["tolist in read_step_flags"]
    assert run.weights_check.step == 1 and float(run.weights_check.bad) == 0.0  # step 1's update: finite
    run.state.step = 1
    second = counter.during(lambda: optimizer_step(run, batches, totals, 1e-3))
    assert second == ["tolist in read_step_flags"]  # the gradient norm and step 1's weights, in one read
    run.state.step = 2
    # step 3's update overflows the weights (finite gradients; as --learning_rate 1e20 --weight_decay 1e20)
    run.optimizer.param_groups[0]["weight_decay"] = 1e20
    assert step(run, batches, 1e20)
    assert run.weights_check.step == 3 and float(run.weights_check.bad) == 1.0
    before = {name: p.detach().clone() for name, p in run.raw_model.named_parameters()}
    with pytest.raises(TrainingError, match=r"^step 3 made the weights non-finite \(--learning_rate 0\.001 or "
                                            r"--weight_decay 0\.1 too large\?\)"):
        counter.during(lambda: optimizer_step(run, batches, totals, 1e-3))  # step 4 stops at its one read
    assert counter.calls == ["tolist in read_step_flags"]
    for name, p in run.raw_model.named_parameters():  # step 4 did not update them
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, equal_nan=True)
    assert run.state.step == 3 and run.weights_check is None


@pytest.mark.parametrize("reader", [save, evaluate_and_select])
def test_a_save_or_an_evaluation_reads_the_pending_check_before_anything_else(reader):
    run = tiny_run(torch.device("cpu"))
    batches = micro_batches()
    assert step(run, batches, 1e-3)
    settle_weights_check(run)  # finite: nothing happens
    assert run.weights_check is None
    run.optimizer.param_groups[0]["weight_decay"] = 1e20
    assert step(run, batches, 1e20)
    # the run has no data, logger or tokenizer: anything past the check would fail otherwise
    with pytest.raises(TrainingError, match="^step 2 made the weights non-finite"):
        reader(run)
