"""The log window's throughput: tokens per second over all processes, model FLOPs per second per
process (model/flops.py) and, on a GPU, MFU against its datasheet peak
(trainer/runtime/datasheets.py) and the most memory allocated since the line before."""

from __future__ import annotations

import torch

from model.flops import mfu
from trainer.runtime.datasheets import datasheet_peak

GIB = 2**30


class Throughput:
    """The work of the steps since the last log line (every process's, as the ranks agreed on it
    before each step: `StepTotals`), turned into the log line's figures."""

    def __init__(self, device: torch.device, dtype: torch.dtype, world_size: int):
        self.device, self.world_size = device, world_size
        self.peak = datasheet_peak(device, dtype)  # None: a CPU, a GPU outside the table, float32 on TF32
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

    def figures(self, elapsed: float) -> dict:
        """The window's figures over `elapsed` seconds of training; the next window starts empty. On a
        GPU the allocator's peak is read and reset on the host (no wait for the device)."""
        per_process = self.flops / self.world_size
        figures = {"tokens_per_s": self.tokens / elapsed, "model_tflops_per_s": per_process / elapsed / 1e12}
        if self.peak is not None:
            figures["mfu"] = mfu(per_process, elapsed, self.peak)
        if self.device.type == "cuda":
            figures["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
        self.clear()
        return figures
