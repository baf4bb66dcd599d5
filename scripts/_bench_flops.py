"""Model FLOPs of the trainer's step and the peak they are compared with (MFU).

Model FLOPs of one micro-batch (forward + backward = 3 x forward; a multiply-add is 2 FLOPs):
``6 * N_body * computed_tokens + 6 * hidden * vocab * logit_positions + 12 * layers * heads *
head_dim * causal_pairs`` (docs/benchmarks.md explains each term). The peak: on a GPU the dense
tensor-core figure of its datasheet, found by the device's name, else the best of a few large
matmuls timed with CUDA events; on a CPU the best of a few matmuls timed with the host clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from model.feed_forward import MiniMindMoE
from model.packed_attention import document_starts
from scripts._bench_common import DeviceTimer, synchronize

TERA = 1e12


@dataclass(frozen=True)
class Datasheet:
    """A GPU's dense peaks in TFLOP/s, bf16/fp16 tensor cores (fp32 accumulation) and IEEE fp32, and
    its memory bandwidth in TB/s (the roofline of scripts/_step_bytes.py)."""

    name: str
    bf16: float
    fp32: float
    memory: float

    def peak(self, dtype_name: str) -> float:
        return (self.fp32 if dtype_name == "float32" else self.bf16) * TERA

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.memory * TERA


# Searched in order, first match wins (an H100 NVL before the H100 SXM; the L40S before the L4).
# Dense figures: NVIDIA's datasheets give bf16 with sparsity, twice these. Where a name covers cards
# of several memories (GH200 of HBM3 or HBM3e, A100 of 40 or 80 GB) the bandwidth is the first's.
DATASHEETS = (
    (r"\bGH200\b", Datasheet("GH200", 989.4, 67.0, 4.0)),
    (r"\bH200 NVL\b", Datasheet("H200 NVL", 835.5, 60.0, 4.8)),
    (r"\bH200\b", Datasheet("H200 SXM", 989.4, 67.0, 4.8)),
    (r"\bH100 NVL\b", Datasheet("H100 NVL", 835.5, 60.0, 3.9)),
    (r"\bH100\b.*\bPCIe\b", Datasheet("H100 PCIe", 756.0, 51.0, 2.0)),
    (r"\bH100\b", Datasheet("H100 SXM", 989.4, 67.0, 3.35)),
    (r"\bA100\b", Datasheet("A100", 312.0, 19.5, 1.555)),
    (r"\bL40S\b", Datasheet("L40S", 362.1, 91.6, 0.864)),
    (r"\bL40\b", Datasheet("L40", 181.0, 90.5, 0.864)),
    (r"\bL4\b", Datasheet("L4", 121.0, 30.3, 0.3)),
    (r"\bA10\b", Datasheet("A10", 125.0, 31.2, 0.6)),
    (r"\bRTX A6000\b", Datasheet("RTX A6000", 154.8, 38.7, 0.768)),
    (r"\bRTX 4090\b", Datasheet("GeForce RTX 4090", 165.2, 82.6, 1.008)),
    (r"\bRTX 3090\b", Datasheet("GeForce RTX 3090", 71.0, 35.6, 0.936)),
)


def datasheet_for(device_name: str) -> Datasheet | None:
    """The datasheet of the GPU `torch.cuda.get_device_name` calls `device_name`, or None."""
    for pattern, sheet in DATASHEETS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return sheet
    return None


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


def causal_pairs(batch: dict) -> int:
    """(query, key) pairs a causal kernel computes: per row, or per document of a packed row."""
    rows, length = batch["input_ids"].shape
    if "position_ids" not in batch:
        return rows * length * (length + 1) // 2
    _, lengths = document_starts(batch["position_ids"])
    return int((lengths * (lengths + 1) // 2).sum())


def body_parameters(model: torch.nn.Module) -> int:
    """Parameters each token works with, except the embedding table (a lookup) and the LM head:
    of a mixture-of-experts MLP only the top-k of its experts (and its router) count."""
    embedding_and_head = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    total = sum(p.numel() for p in model.parameters() if id(p) not in embedding_and_head)
    for module in model.modules():
        if isinstance(module, MiniMindMoE):
            expert_parameters = sum(p.numel() for p in module.experts.parameters())
            total -= expert_parameters - expert_parameters * module.top_k // module.num_experts
    return total


def model_flops(model: torch.nn.Module, computed_tokens: int, logit_positions: int, pairs: int) -> int:
    """FLOPs of forward + backward over this work (module docstring)."""
    config = model.config
    attention_width = config.num_attention_heads * config.head_dim
    return (6 * body_parameters(model) * computed_tokens
            + 6 * config.hidden_size * config.vocab_size * logit_positions
            + 12 * config.num_hidden_layers * attention_width * pairs)


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / seconds / peak
