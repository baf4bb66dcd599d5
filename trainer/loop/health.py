"""Non-finite steps and weights: decided on the device, read by the host only at the loop's reads.

A step whose gradient norm is not finite is skipped on the device: fused AdamW gets `found_inf`
(as the GradScaler hands it over under float16), so neither the weights, the moments nor the
step counter move, and nothing waits for the device. Each step leaves two flags on the device
(finite; counted as bad: non-finite, and under float16 only once the loss scale has collapsed
below 1, since the scaler skips overflowing steps while it calibrates). The host reads them
(`read_steps`, one transfer for all steps since the last read):

- at every log line, save and evaluation, and at the end of the run;
- every min(--log_interval, --max_bad_steps) steps, and after every step while a run of bad
  steps is going on: so a streak of --max_bad_steps bad steps is seen at the very step that
  completes it, and the run stops there with the weights of the last good step (a skipped step
  changes nothing) and exactly the counts of a run that read every step.

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
from trainer.runtime.distributed import all_reduce_sum


class StepFlags(NamedTuple):
    step: int  # the optimizer step (numbered from 1)
    flags: torch.Tensor  # [finite, counted as bad] (bool, on the device)


@dataclass
class StepHealth:
    """The flags not read yet, and what the reads found since the last log line / weights check."""

    pending: list[StepFlags] = field(default_factory=list)
    window_finite: list[bool] = field(default_factory=list)  # each step of the log window, in order
    applied_since_check: list[int] = field(default_factory=list)  # steps whose update was applied

    def take_window(self) -> list[bool]:
        window, self.window_finite = self.window_finite, []
        return window


def step_flags(finite: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """[finite, counted as bad] of a step, on the device (after `scaler.update()`)."""
    counted = ~finite
    if scaler.is_enabled():
        # the scale after this step's update; GradScaler.get_scale() would read it on the host
        counted = counted & (scaler._get_scale_async() < 1.0)
    return torch.stack([finite, counted])


def reads_due(run) -> bool:
    """Whether the step just taken must read the flags (see the module docstring)."""
    every = min(run.args.log_interval, run.args.max_bad_steps)
    return run.state.step % every == 0 or run.state.bad_steps_in_a_row > 0


def read_steps(run, check_weights: bool) -> int | None:
    """Read the pending flags (and the weights check) in one transfer; count skipped and bad steps.
    Raises TrainingError if the weights went non-finite; returns the step at which --max_bad_steps
    bad steps in a row were reached (the caller saves and stops), else None."""
    health, state = run.health, run.state
    pending, health.pending = health.pending, []
    parts = [record.flags.float() for record in pending]
    if check_weights:
        parts.append(non_finite_weights(run)[None])
    if not parts:
        return None
    values = torch.cat(parts).tolist()
    for index, record in enumerate(pending):
        finite = values[2 * index]
        health.window_finite.append(bool(finite))
        if finite:
            health.applied_since_check.append(record.step)
    if check_weights:
        applied, health.applied_since_check = health.applied_since_check, []
        if values[-1]:
            raise_non_finite_weights(run, applied)
    for index, record in enumerate(pending):
        if values[2 * index]:
            state.bad_steps_in_a_row = 0
            continue
        state.skipped_steps += 1
        if not values[2 * index + 1]:
            continue
        state.bad_steps_in_a_row += 1
        run.logger.print(
            f"warning: step {record.step} had a non-finite loss or gradient norm: optimizer step skipped "
            f"({state.bad_steps_in_a_row} in a row, {state.skipped_steps} in total)"
        )
        if state.bad_steps_in_a_row >= run.args.max_bad_steps:
            return record.step
    return None


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
