"""Which fused attention kernel SDPA runs on a GPU.

On Hopper and newer GPUs recent torch builds rank cuDNN's attention first. cuDNN builds an execution
plan for every new (batch, heads, length) shape, and the trainer's batches change length nearly
every step (padding to the longest row of each batch, grouped or not): a plan build per step, in
every layer's forward and backward. FlashAttention has no per-shape setup and serves the same
calls (bf16/fp16, causal, no mask); the memory-efficient kernel serves what it cannot (float32, a
padding mask at generation). So cuDNN attention is switched off for the process. The packed path
calls FlashAttention's varlen kernel directly and is not affected.
"""

import torch


def prefer_flash_attention() -> None:
    """SDPA chooses among FlashAttention, the memory-efficient kernel and the math fallback (CUDA
    only; CPU kernels are untouched)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
