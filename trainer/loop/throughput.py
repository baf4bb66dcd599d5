"""The log window's throughput: tokens per second over all processes, model FLOPs per second per
process (model/flops.py) and, on a GPU, MFU against its datasheet peak
(trainer/runtime/datasheets.py) and the most memory allocated since the line before; and the
average step time the ETA takes.

The first step of a process also starts the DataLoader's workers, compiles (--use_compile 1),
selects kernels and fills the allocator: its time and work are left out of its window's figures
where that window holds later steps (reported as `first_step_s`), and out of every ETA after it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from model.flops import mfu
from trainer.runtime.datasheets import datasheet_peak

GIB = 2**30


class FirstStep(NamedTuple):
    """A process's first optimizer step: seconds from the loop's start to its end, and its work."""

    seconds: float
    tokens: int
    flops: int


class Throughput:
    """The work of the steps since the last log line (every process's, as the ranks agreed on it
    before each step: `StepTotals`), turned into the log line's figures."""

    def __init__(self, device: torch.device, dtype: torch.dtype, world_size: int):
        self.device, self.world_size = device, world_size
        self.peak = datasheet_peak(device, dtype)  # None: a CPU, a GPU outside the table, float32 on TF32
        self.first: FirstStep | None = None  # set after the process's first step
        self.first_in_window = False  # whether the window holds it
        self.clear()
        if device.type == "cuda":  # the first line's peak is of its steps, not of loading the model or checkpoint
            torch.cuda.reset_peak_memory_stats(device)

    def add(self, real_tokens: int, flops: int) -> None:
        """One optimizer step's non-pad tokens and model FLOPs, summed over the processes."""
        self.tokens += real_tokens
        self.flops += flops

    def clear(self) -> None:
        """Forget the work added so far (a window that starts again)."""
        self.tokens = self.flops = 0

    def first_step_done(self, seconds: float) -> None:
        """The process's first step ended `seconds` after the loop started (the device's work included)."""
        self.first, self.first_in_window = FirstStep(seconds, self.tokens, self.flops), True

    def seconds_per_step(self, seconds: float, steps: int) -> float:
        """The average time of the `steps` this process took in `seconds`, the first step left out once
        there are others."""
        if self.first is not None and steps > 1:
            return (seconds - self.first.seconds) / (steps - 1)
        return seconds / max(steps, 1)

    def figures(self, elapsed: float, steps: int) -> dict:
        """The figures of a window of `steps` steps over `elapsed` seconds of training; the next window
        starts empty. On a GPU the allocator's peak is read and reset on the host (no wait for the device)."""
        tokens, flops, left_out = self.tokens, self.flops, {}
        if self.first_in_window and steps > 1:
            elapsed = max(elapsed - self.first.seconds, 1e-9)
            tokens, flops = tokens - self.first.tokens, flops - self.first.flops
            left_out = {"first_step_s": self.first.seconds}
        self.first_in_window = False
        per_process = flops / self.world_size
        figures = {"tokens_per_s": tokens / elapsed, "model_tflops_per_s": per_process / elapsed / 1e12, **left_out}
        if self.peak is not None:
            figures["mfu"] = mfu(per_process, elapsed, self.peak)
        if self.device.type == "cuda":
            figures["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
        self.clear()
        return figures
