"""Cosine learning rate with linear warmup, a pure function of the optimizer step.

Being a function of the step (not an object with hidden state) makes resume trivial: the
checkpoint's step is the schedule's position.
"""

import math

from trainer.loop.step_count import run_steps
from trainer.run_logger import format_count


def cosine_lr(step: int, total_steps: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR for optimizer step `step` (0-based) of `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


RECORD_KEYS = ("total_steps", "warmup_steps", "peak_lr", "min_lr_ratio")


def schedule_record(total_steps: int, warmup_steps: int, peak_lr: float, min_lr_ratio: float) -> dict:
    """The schedule a run trains on, as its checkpoints record it (`lr_schedule`)."""
    return dict(zip(RECORD_KEYS, (total_steps, warmup_steps, peak_lr, min_lr_ratio)))


def recorded_schedule(value) -> dict | None:
    """A checkpoint's `lr_schedule` where it is one (`schedule_record`'s keys, each a finite number,
    the warmup a non-negative whole one; other keys are left out), else None, as for a checkpoint
    that records none."""
    if not isinstance(value, dict) or not set(RECORD_KEYS) <= set(value):
        return None
    record = {key: value[key] for key in RECORD_KEYS}
    warmup = record["warmup_steps"]
    finite = all(isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v) for v in record.values())
    return record if finite and isinstance(warmup, int) and warmup >= 0 else None


def unrecorded_schedule(saved: dict, dataset_len: int, trained_lr: float | None) -> dict | None:
    """The schedule of a checkpoint that records none (or records it damaged), from its own flags
    (`saved["args"]`): the run that wrote it counted at its start its total of optimizer steps (those
    done and those left in its epochs at its global batch of `saved["world_size"]` x --batch_size x
    --accumulation_steps samples, capped by --max_steps) and its warmup (--warmup_steps, else 3% of
    that total). Counted from the checkpoint's position with those flags, the total is that start's
    again: each step since then took one global batch (counted by trainer/loop/step_count.py, as the
    loop counts). Taken only where it gives the rate the checkpoint's last step trained at
    (`trained_lr`), else None: the warmup is then counted afresh."""
    flags = saved.get("args")
    if trained_lr is None or not isinstance(flags, dict):
        return None
    try:
        world, batch, accumulation = saved["world_size"], flags["batch_size"], flags.get("accumulation_steps", 1)
        step, epoch, start, epochs = saved["step"], saved["epoch"], saved["samples_in_epoch"], flags["epochs"]
        max_steps, warmup = flags.get("max_steps") or 0, flags.get("warmup_steps")
        peak, floor_ratio = flags["learning_rate"], flags["min_lr_ratio"]
    except KeyError:
        return None
    counts = (world, batch, accumulation, step, epoch, start, epochs, max_steps)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or min(
            world, batch, accumulation) < 1 or step < 1:
        return None
    total = run_steps(dataset_len, world, batch, accumulation, epochs, max_steps, step, epoch, start)
    record = recorded_schedule(schedule_record(total, default_warmup_steps(total) if warmup is None else warmup,
                                               peak, floor_ratio))
    if record is None or not _same_rate(cosine_lr(step - 1, *_curve(record)), trained_lr):
        return None
    return record


def _curve(schedule: dict) -> tuple:
    """`cosine_lr`'s arguments after the step, from a schedule record."""
    return schedule["total_steps"], schedule["peak_lr"], schedule["warmup_steps"], schedule["min_lr_ratio"]


def _same_rate(computed: float, trained: float) -> bool:
    """Whether a rate this code computes is the one a checkpoint's optimizer holds (float rounding apart)."""
    return math.isclose(computed, trained, rel_tol=1e-6, abs_tol=1e-12)


def warmup_afresh(flag: int | None, resumed: dict | None, step: int, named: str, total_steps: int) -> str | None:
    """The note of a resume past step 0 whose checkpoint gives no schedule (`unrecorded_schedule` found
    none its flags reproduce) and no --warmup_steps: its warmup (`named`) is 3% of this run's total,
    which need not be the one the checkpoint's run counted."""
    if flag is not None or resumed is not None or step == 0:
        return None
    return (f"note: the checkpoint records no learning rate schedule, nor one its flags reproduce: {named} is counted "
            f"afresh, from this run's {format_count(total_steps, 'optimizer step')}")


def _finite(number: int | float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int beyond any float
        return False


def described(schedule: dict) -> str:
    """A schedule record in words."""
    return (f"{format_count(schedule['total_steps'], 'optimizer step')}, warmup {schedule['warmup_steps']}, peak "
            f"{schedule['peak_lr']:.4g}, floor {schedule['peak_lr'] * schedule['min_lr_ratio']:.4g}")


def schedule_change(step: int, resumed_lr: float | None, resumed: dict | None, schedule: dict) -> str | None:
    """What to say where a resume at `step` continues on another curve than the checkpoint's run: the
    total counts optimizer steps of the global batch (processes x batch x accumulation), so another
    global batch, --epochs or --max_steps (or another peak, warmup or floor) moves the learning rate.
    `resumed`: the checkpoint's schedule record (None where it records none), which differs also where
    the rate at its last step is the same on both (a step of the warmup, which no floor changes; the
    peak); `schedule`: this run's (`schedule_record`)."""
    if resumed_lr is None or step == 0:
        return None
    curve = _curve(schedule)
    here = cosine_lr(step - 1, *curve)
    if _same_rate(here, resumed_lr) and resumed in (None, schedule):
        return None
    theirs = f" ({described(resumed)})" if resumed else ""
    return (f"note: this run's learning rate schedule ({described(schedule)}) is not the checkpoint's{theirs}: its "
            f"step {step} trained at {resumed_lr:.4g}, this schedule gives {here:.4g} there, and the run goes on at "
            f"{cosine_lr(step, *curve):.4g}")


def run_warmup(flag: int | None, resumed: dict | None, step: int, total_steps: int) -> tuple[int, str]:
    """The run's warmup and how to name it: --warmup_steps where given; else, on a resume past step 0, the
    checkpoint's (`resumed`, its schedule: the warmup counted at the run's first start, or the flag of the
    last start that gave one), so that a recounted total (another global batch, --epochs or --max_steps)
    moves the cosine but never sends a run past its warmup into a new one, nor ends a warmup early; else
    3% of `total_steps`."""
    if flag is not None:
        return flag, f"--warmup_steps {flag}"
    kept = bool(resumed) and step > 0
    warmup = resumed["warmup_steps"] if kept else default_warmup_steps(total_steps)
    return warmup, f"the warmup of {format_count(warmup, 'step')}" + (" of the checkpoint's schedule" if kept else "")


def warmup_too_long(warmup: int, named: str, total_steps: int, peak_lr: float) -> str | None:
    """The warning where the warmup (`named`) is longer than the run: the rate never reaches the peak."""
    if not warmup > total_steps > 0:
        return None
    return (f"warning: {named} is longer than the run's {format_count(total_steps, 'optimizer step')}: the learning rate ends at "
            f"{cosine_lr(total_steps - 1, total_steps, peak_lr, warmup, 0):.3g}, below --learning_rate {peak_lr:g}")


def default_warmup_steps(total_steps: int) -> int:
    return max(1, round(0.03 * total_steps)) if total_steps > 1 else 0


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
