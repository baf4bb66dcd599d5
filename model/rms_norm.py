"""RMSNorm: y = w * (x / rms(x)), rms(x) = sqrt(mean(x^2) + eps) over the last dimension.

On a GPU it is ATen's fused kernel (`F.rms_norm` on a CUDA tensor runs `_fused_rms_norm`): one
kernel forward and its fused backward, statistics in float32, where the same expression written
out costs a dozen kernels each way (a step runs four norms per block). Elsewhere (CPU) it is the
expression with a hand-written backward: autograd's backward of the written-out expression runs
fourteen ops per norm (one per node of the graph: the pow, the mean, the rsqrt, each product);
the closed form below runs nine, n among them: it saves x and 1 / rms(x), as the fused kernel
does, and computes n again. With n = x / rms(x) and g the gradient of y:

    dL/dw = sum over rows of g * n
    dL/dx = (g * w - n * mean(g * w * n)) / rms(x)

Both run in x's dtype with autocast off (CUDA autocast runs pow and rsqrt in float32, which
would make the output, and the residual stream after it, float32), float16 excepted: its squares
overflow from 256 on (its largest value is 65504), which would make the RMS infinite and the row
zeros, so in float16 the statistics, n and both gradients are computed in float32 (as ATen's
kernel does on a GPU) and the output and gradients rounded to float16 once. bfloat16 has
float32's range: its statistics stay in bfloat16, the written-out expression's own results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class _RMSNormFunction(torch.autograd.Function):
    # forward(ctx, ...) rather than a separate setup_context: autograd.Function.apply binds the
    # default arguments of a setup_context-style forward through inspect.signature on every call.
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(statistics_dtype(x.dtype))
        inverse = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        # x and the statistics are saved, as ATen's fused kernel saves them, not n: x is often a
        # view whose memory is kept anyway (q and k of the joined q/k/v GEMM's output, which the
        # attention keeps for v), where n would be a second tensor of x's size
        ctx.save_for_backward(weight, x, inverse)
        out = weight * (wide * inverse)
        # no `.to` that would return `out` itself: torch 2.11's compiler gives wrong gradients for it
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    @once_differentiable  # x and inverse are saved as constants: no second derivative
    def backward(ctx, grad):
        weight, x, inverse = ctx.saved_tensors
        normed = x.to(inverse.dtype) * inverse  # the forward's n, the same product bit for bit
        wide = grad.to(normed.dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (wide * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_normed = wide * weight.to(normed.dtype)
            grad_x = ((grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)) * inverse).to(grad.dtype)
        return grad_x, grad_weight, None


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the closed form's statistics, n and gradients for inputs of `dtype`."""
    return torch.float32 if dtype == torch.float16 else dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps) in x's dtype; `weight` is cast to it."""
    with torch.autocast(x.device.type, enabled=False):
        weight = weight.to(x.dtype)
        if x.is_cuda:
            return aten_rms_norm(x, weight, eps)
        return _RMSNormFunction.apply(x, weight, eps)


def aten_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ATen's RMSNorm over the last dimension (fused on CUDA), `weight` in x's dtype."""
    return F.rms_norm(x, weight.shape, weight, eps)


class MiniMindRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """In x's dtype (the compute dtype: bf16 under bf16 autocast), so that the next GEMM reads
        it as it is; `weight`: this norm's weight already in that dtype (`ComputeWeights`)."""
        return rms_norm(x, self.weight if weight is None else weight, self.eps)
