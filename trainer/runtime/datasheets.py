"""GPUs' datasheet peaks, found by the device's name: what MFU is taken against (the trainer's log
line, scripts/bench.py) and the roofline's bandwidth (scripts/_step_bytes.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

TERA = 1e12


@dataclass(frozen=True)
class Datasheet:
    """A GPU's dense peaks in TFLOP/s, bf16/fp16 tensor cores (fp32 accumulation) and IEEE fp32, and
    its memory bandwidth in TB/s."""

    name: str
    bf16: float
    fp32: float
    memory: float

    def peak(self, dtype_name: str) -> float:
        """FLOP/s of a run in `dtype_name`: bf16 and fp16 on tensor cores, float32 in IEEE fp32 (TF32
        is a mode the run may use, not the figure it is held to)."""
        return (self.fp32 if dtype_name == "float32" else self.bf16) * TERA

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.memory * TERA


# Searched in order, first match wins (an H100 NVL before the H100 SXM; the L40S before the L4). The
# RTX 4090 D, a 4090 of fewer cores, and the A10G, whose figures NVIDIA publishes no datasheet of,
# have none.
# Dense figures: NVIDIA's datasheets give bf16 with sparsity, twice these. Where a name covers cards
# of several memories (GH200 of HBM3 or HBM3e, A100 of 40 or 80 GB) the bandwidth is the first's.
DATASHEETS = (
    (r"\bGH200\b", Datasheet("GH200", 989.4, 67.0, 4.0)),
    (r"\bH200 NVL\b", Datasheet("H200 NVL", 835.5, 60.0, 4.8)),
    (r"\bH200\b", Datasheet("H200 SXM", 989.4, 67.0, 4.8)),
    (r"\bH100 NVL\b", Datasheet("H100 NVL", 835.5, 60.0, 3.9)),
    (r"\bH100\b.*\bPCIe\b", Datasheet("H100 PCIe", 756.0, 51.0, 2.0)),
    (r"\bH100\b", Datasheet("H100 SXM", 989.4, 67.0, 3.35)),
    (r"\bH800\b.*\bPCIe\b", Datasheet("H800 PCIe", 756.0, 51.0, 2.0)),
    (r"\bH800\b", Datasheet("H800 SXM", 989.4, 67.0, 3.35)),
    (r"\bH20\b", Datasheet("H20", 148.0, 44.0, 4.0)),
    (r"\bA100\b", Datasheet("A100", 312.0, 19.5, 1.555)),
    (r"\bL40S\b", Datasheet("L40S", 362.1, 91.6, 0.864)),
    (r"\bL40\b", Datasheet("L40", 181.0, 90.5, 0.864)),
    (r"\bL4\b", Datasheet("L4", 121.0, 30.3, 0.3)),
    (r"\bA10\b", Datasheet("A10", 125.0, 31.2, 0.6)),
    (r"\bRTX A6000\b", Datasheet("RTX A6000", 154.8, 38.7, 0.768)),
    (r"\bRTX 4090\b(?! D\b)", Datasheet("GeForce RTX 4090", 165.2, 82.6, 1.008)),
    (r"\bRTX 3090\b", Datasheet("GeForce RTX 3090", 71.0, 35.6, 0.936)),
)


def datasheet_for(device_name: str) -> Datasheet | None:
    """The datasheet of the GPU `torch.cuda.get_device_name` calls `device_name`, or None."""
    for pattern, sheet in DATASHEETS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return sheet
    return None


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    """The datasheet peak FLOP/s of a run in `dtype` on `device`: None on a CPU, a GPU outside the
    table, or for float32 with TF32 matmuls on (`--tf32 1`: the tensor cores' TF32 rate, which the
    table does not hold, is several times the IEEE fp32 peak; held to that, the MFU would pass 100%)."""
    if device.type != "cuda" or (dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32):
        return None
    sheet = datasheet_for(torch.cuda.get_device_name(device))
    return sheet.peak(str(dtype).removeprefix("torch.")) if sheet else None
