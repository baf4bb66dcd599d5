"""Cosine learning rate with linear warmup, a pure function of the optimizer step.

Being a function of the step (not an object with hidden state) makes resume trivial: the
checkpoint's step is the schedule's position.
"""

import math


def cosine_lr(step: int, total_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR for optimizer step `step` (0-based) of `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_change(step: int, resumed_lr: float | None, total_steps: int, peak_lr: float, warmup_steps: int,
                    min_lr_ratio: float) -> str | None:
    """What to say where a resume at `step` continues on another curve than the checkpoint's run: the
    total counts optimizer steps of the global batch (processes x batch x accumulation), so another
    global batch, --epochs or --max_steps (or another peak, warmup or floor) moves the learning rate."""
    if resumed_lr is None or step == 0:
        return None
    here = cosine_lr(step - 1, total_steps, peak_lr, warmup_steps, min_lr_ratio)
    if math.isclose(here, resumed_lr, rel_tol=1e-6, abs_tol=1e-12):
        return None
    return (f"note: this run's learning rate schedule ({total_steps} optimizer steps, warmup {warmup_steps}) is not "
            f"the checkpoint's: its step {step} trained at {resumed_lr:.4g}, this schedule gives {here:.4g} there, "
            f"and the run goes on at {cosine_lr(step, total_steps, peak_lr, warmup_steps, min_lr_ratio):.4g}")


def default_warmup_steps(total_steps: int) -> int:
    return max(1, round(0.03 * total_steps)) if total_steps > 1 else 0


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
