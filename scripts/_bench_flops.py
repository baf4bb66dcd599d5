"""The peak a benchmark's model FLOPs (model/flops.py) are compared with (MFU): on a GPU the dense
tensor-core figure of its datasheet, found by the device's name (trainer/runtime/datasheets.py), else
the best of a few large matmuls timed with CUDA events; on a CPU the best of a few matmuls timed with
the host clock.
"""

from __future__ import annotations

import torch

from scripts._bench_common import DeviceTimer, synchronize
from trainer.runtime.datasheets import datasheet_for


def measured_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` [size x size] @ [size x size] matmuls in `dtype` on `device`
    (each timed with DeviceTimer: CUDA events on a GPU)."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    right = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    torch.matmul(left, right)  # warm-up: kernel selection, allocation
    synchronize(device)
    timer, best = DeviceTimer(device), float("inf")
    for _ in range(repeats):
        timer.start()
        torch.matmul(left, right)
        best = min(best, timer.stop())
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype_name: str, matmul_size: int) -> tuple[float, str]:
    """(peak FLOP/s of a run in `dtype_name` on `device`, where it comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = datasheet_for(name)
        if sheet is not None:
            return sheet.peak(dtype_name), f"datasheet of the {sheet.name} ({name}), dense"
        source = f"best {matmul_size}^3 matmul timed with CUDA events ({name} is not in the datasheet table)"
    else:
        source = f"best {matmul_size}^3 matmul on this CPU"
    return measured_peak(device, getattr(torch, dtype_name), matmul_size), source

