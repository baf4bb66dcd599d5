"""Non-finite steps and weights: decided on the device, read by the host only at the loop's reads.

A step whose gradient norm is not finite is skipped on the device: fused AdamW gets `found_inf`
(as the GradScaler hands it over under float16), so neither the weights, the moments nor the
step counter move, and nothing waits for the device. Each step leaves two flags on the device
(finite; counted as bad: non-finite, and under float16 only once the loss scale has collapsed
below 1, since the scaler skips overflowing steps while it calibrates). The host reads them
(`read_steps`, one transfer for all steps since the last read) at every log line, save and
evaluation, and at the end of the run: no read between log lines.

--max_bad_steps is counted on the device as well (`DeviceStreak`): the step that completes a
streak of bad steps sets a flag there that skips every later update, so the weights stay those of
the last good step however many steps the host queues before its next read. That read finds the
step that completed the streak and puts the run back where that step left it (`StepRecord`: its
position in the data, its learning rate, the generators dropout draws from, the float16 loss
scale): the run stops there, and saves, exactly as a run that read every step would.

The weights themselves (a huge learning rate turns finite gradients into inf/NaN weights) are
checked at every log line, save and evaluation, in the same transfer: a non-finite weight never
reaches a file, and the run stops naming the step that broke them, the only step since the last
check whose update was applied (or the range of those steps, when several were).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from trainer.errors import TrainingError
from trainer.loop.lr_schedule import set_lr
from trainer.runtime.distributed import all_reduce_sum
from trainer.runtime.seeding import restore_step_generators, step_generators


class StepRecord(NamedTuple):
    """A step as the host left it, until its flags are read: what a stop at this step restores."""

    step: int  # the optimizer step (numbered from 1)
    flags: torch.Tensor  # [finite, counted as bad] (bool, on the device)
    epoch: int  # the run's position after the step (TrainState)
    samples_in_epoch: int
    lr: float  # the rate the step trained at
    generators: dict  # the generators a step draws from, after it (`step_generators`)
    # float16: the GradScaler's scale (its growth tracker is 0 after a bad step, and after the skipped ones)
    loss_scale: torch.Tensor | None


class DeviceStreak:
    """Bad steps in a row, counted on the device as the host counts them when it reads the flags
    (`read_steps`), from the count the run started with; `stopped` is set by the step that makes
    them --max_bad_steps, and skips the update of every step after it (`optimizer_step`)."""

    def __init__(self, in_a_row: int, device: torch.device):
        self.in_a_row = torch.full((), in_a_row, dtype=torch.int32, device=device)
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)

    def count(self, finite: torch.Tensor, counted: torch.Tensor, max_bad_steps: int) -> None:
        self.in_a_row.mul_(~finite).add_(counted)  # a finite step ends a streak; a counted one adds to it
        self.stopped.logical_or_(counted & (self.in_a_row >= max_bad_steps))


@dataclass
class StepHealth:
    """The steps not read yet, and what the reads found since the last log line / weights check."""

    pending: list[StepRecord] = field(default_factory=list)
    window_finite: list[bool] = field(default_factory=list)  # each step of the log window, in order
    applied_since_check: list[int] = field(default_factory=list)  # steps whose update was applied
    streak: DeviceStreak | None = None  # from the run's first step

    def take_window(self) -> list[bool]:
        window, self.window_finite = self.window_finite, []
        return window


def device_streak(run) -> DeviceStreak:
    """The run's streak on the device, made at its first step from the count its checkpoint saved."""
    health = run.health
    if health.streak is None:
        health.streak = DeviceStreak(run.state.bad_steps_in_a_row, run.ctx.device)
    return health.streak


def record_step(run, finite: torch.Tensor, lr: float) -> None:
    """After the step `run.state` has just counted (`finite`: its update was applied unless the
    streak had `stopped`): its flags on the device, the streak counted there, and what a stop at this
    step restores."""
    scaler, state = run.scaler, run.state
    counted = ~finite
    loss_scale = None
    if scaler.is_enabled():
        # the scale after this step's update; GradScaler.get_scale() would read it on the host
        scale = scaler._get_scale_async()
        counted = counted & (scale < 1.0)
        loss_scale = scale.clone()
    device_streak(run).count(finite, counted, run.args.max_bad_steps)
    run.health.pending.append(StepRecord(state.step, torch.stack([finite, counted]), state.epoch,
                                         state.samples_in_epoch, lr, step_generators(run.ctx.device), loss_scale))


def back_to(run, record: StepRecord) -> None:
    """The run as `record`'s step left it: the steps the host queued after it changed no weight, no
    optimizer state (their updates were skipped on the device), only the run's position, the rate,
    the generators and the loss scale, which go back here."""
    state = run.state
    state.step, state.epoch, state.samples_in_epoch = record.step, record.epoch, record.samples_in_epoch
    set_lr(run.optimizer, record.lr)
    restore_step_generators(record.generators, run.ctx.device)
    if record.loss_scale is not None:
        run.scaler._get_scale_async().copy_(record.loss_scale)


def read_steps(run) -> int | None:
    """Read the pending flags and the weights check in one transfer; count skipped and bad steps.
    Raises TrainingError if the weights went non-finite; returns the step at which --max_bad_steps
    bad steps in a row were reached, with the run put back where that step left it (the caller
    saves and stops), else None."""
    health, state = run.health, run.state
    pending, health.pending = health.pending, []
    flags = [record.flags.float() for record in pending]
    values = torch.cat([*flags, non_finite_weights(run)[None]]).tolist()
    stop = None
    for index, record in enumerate(pending):
        finite, counted = values[2 * index], values[2 * index + 1]
        health.window_finite.append(bool(finite))
        if finite:
            health.applied_since_check.append(record.step)
            state.bad_steps_in_a_row = 0
            continue
        state.skipped_steps += 1
        if not counted:
            continue
        state.bad_steps_in_a_row += 1
        run.logger.print(
            f"warning: step {record.step} had a non-finite loss or gradient norm: optimizer step skipped "
            f"({state.bad_steps_in_a_row} in a row, {state.skipped_steps} in total)"
        )
        if state.bad_steps_in_a_row >= run.args.max_bad_steps:
            stop = record  # the device skipped the updates of the steps after it (`DeviceStreak`)
            break
    applied, health.applied_since_check = health.applied_since_check, []
    if values[-1]:
        raise_non_finite_weights(run, applied)
    if stop is None:
        return None
    back_to(run, stop)
    return stop.step


@torch.no_grad()
def non_finite_weights(run) -> torch.Tensor:
    """On the device: 1.0 if some weight is inf/NaN, else 0.0 (the same on every rank).

    The smallest and the largest value of each parameter (one `aminmax` pass): a NaN anywhere makes
    them NaN, an inf makes one of them inf, finite values keep them finite, so they are all finite
    exactly when every weight is."""
    params = list(run.raw_model.parameters())
    sharded = any(hasattr(p, "to_local") for p in params)  # --fsdp 1: each rank checks its shards
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    extremes = [value for p in local if p.numel() for value in torch.aminmax(p)]  # a rank's shard may be empty
    device = local[0].device if local else run.ctx.device
    bad = (~torch.isfinite(torch.stack(extremes))).any().float() if extremes else torch.zeros((), device=device)
    if sharded:
        all_reduce_sum(bad)  # every rank takes the same decision
    return bad


def raise_non_finite_weights(run, applied: list[int]):
    """The checkpoints already on disk stay the last good ones."""
    what = (f"step {applied[0]} made the weights non-finite" if len(applied) == 1 else
            f"one of the steps {applied[0]}-{applied[-1]} made the weights non-finite" if applied else
            "the weights are non-finite before any update")
    raise TrainingError(
        f"{what} (--learning_rate {run.args.learning_rate:g} or --weight_decay "
        f"{run.args.weight_decay:g} too large?); stopped without saving them. The checkpoints in "
        f"{run.args.save_dir} are the last good weights", every_rank=True)


def bad_steps_error(run, step: int) -> TrainingError:
    state = run.state
    return TrainingError(
        f"{state.bad_steps_in_a_row} optimizer steps in a row had a non-finite loss or gradient norm "
        f"(last at step {step}); stopped. The last good weights are saved in {run.args.save_dir}",
        every_rank=True)
