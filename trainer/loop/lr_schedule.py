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


def schedule_change(step: int, resumed_lr: float | None, resumed: dict | None, total_steps: int, peak_lr: float,
                    warmup_steps: int, min_lr_ratio: float) -> str | None:
    """What to say where a resume at `step` continues on another curve than the checkpoint's run: the
    total counts optimizer steps of the global batch (processes x batch x accumulation), so another
    global batch, --epochs or --max_steps (or another peak, warmup or floor) moves the learning rate.
    `resumed`: the checkpoint's schedule ({total_steps, warmup_steps}; None where it records none), which
    differs also where the rate at its last step is the same on both (a step of the warmup, the peak)."""
    if resumed_lr is None or step == 0:
        return None
    here = cosine_lr(step - 1, total_steps, peak_lr, warmup_steps, min_lr_ratio)
    ours = {"total_steps": total_steps, "warmup_steps": warmup_steps}
    if math.isclose(here, resumed_lr, rel_tol=1e-6, abs_tol=1e-12) and resumed in (None, ours):
        return None
    theirs = f" ({resumed['total_steps']} optimizer steps, warmup {resumed['warmup_steps']})" if resumed else ""
    return (f"note: this run's learning rate schedule ({total_steps} optimizer steps, warmup {warmup_steps}) is not "
            f"the checkpoint's{theirs}: its step {step} trained at {resumed_lr:.4g}, this schedule gives {here:.4g} "
            f"there, and the run goes on at {cosine_lr(step, total_steps, peak_lr, warmup_steps, min_lr_ratio):.4g}")


def run_warmup(flag: int | None, resumed: dict | None, step: int, total_steps: int) -> tuple[int, str]:
    """The run's warmup and how to name it: --warmup_steps where given; else, on a resume past step 0, the
    warmup its run counted at its first start (`resumed`, the checkpoint's schedule), so that a recounted
    total (another global batch, --epochs or --max_steps) moves the cosine but never sends a run past its
    warmup into a new one, nor ends a warmup early; else 3% of `total_steps`."""
    if flag is not None:
        return flag, f"--warmup_steps {flag}"
    if resumed and step > 0:
        return resumed["warmup_steps"], f"the warmup of {resumed['warmup_steps']} steps its run counted at its first start"
    warmup = default_warmup_steps(total_steps)
    return warmup, f"the warmup of {warmup} steps"


def warmup_too_long(warmup: int, named: str, total_steps: int, peak_lr: float) -> str | None:
    """The warning where the warmup (`named`) is longer than the run: the rate never reaches the peak."""
    if not warmup > total_steps > 0:
        return None
    return (f"warning: {named} is longer than the run's {total_steps} optimizer steps: the learning rate ends at "
            f"{cosine_lr(total_steps - 1, total_steps, peak_lr, warmup, 0):.3g}, below --learning_rate {peak_lr:g}")


def default_warmup_steps(total_steps: int) -> int:
    return max(1, round(0.03 * total_steps)) if total_steps > 1 else 0


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
