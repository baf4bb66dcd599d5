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


def default_warmup_steps(total_steps: int) -> int:
    return max(1, round(0.03 * total_steps)) if total_steps > 1 else 0


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
