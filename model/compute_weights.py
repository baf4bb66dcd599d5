"""A block's parameters in the dtype its matmuls run in, cast together.

Under autocast to a dtype other than the parameters' (fp32 weights, bf16 compute), autocast casts
every weight at every GEMM and every norm weight promotes its bf16 input back to fp32, so that the
next GEMM casts it again. `ComputeWeights` casts all the parameters of a block in one go instead:
one concatenation and one cast per forward, one cast of their gradients in the backward. Weights
that sit next to each other in the block (q/k/v, gate/up) are then rows of one matrix of that
buffer, and `linear` runs them as one GEMM. The parameters themselves stay separate tensors,
so every weight format (MiniMind .pth, Qwen3 directories, GGUF, resume checkpoints) is unchanged.

Without a cast to make the parameters are used as they are. In half precision (FSDP's bf16
parameters, a bf16 model without autocast) each group is still one GEMM, over the concatenation of
its weights (a few MB per block, where separate GEMMs would read the input once more per weight and
sum the input's gradients); in fp32 every weight is its own GEMM, the same arithmetic as plain
`nn.Linear` layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `x`'s matmuls run in: autocast's on x's device when enabled, else x's own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def piece_layout(module: nn.Module, groups: list[list[torch.Tensor]] = ()) -> tuple[tuple[int, ...], ...]:
    """The pieces of `module`'s cast buffer as positions in `module.parameters()`: each of `groups`
    (lists of matrices with the same number of columns that run as one GEMM or are used one below
    the other), then every other parameter on its own. Computed once per module, where it is built:
    it tells parameters apart by `id()`, which inside compiled code would be a guard on each
    parameter object (so that each layer compiled a graph of its own)."""
    position = {id(p): i for i, p in enumerate(module.parameters())}
    grouped = tuple(tuple(position[id(p)] for p in group) for group in groups)
    taken = {i for group in grouped for i in group}
    return grouped + tuple((i,) for i in range(len(position)) if i not in taken)


class ComputeWeights:
    """The parameters of `module` in `dtype` (see the module docstring), laid out in the cast buffer
    as `layout` says (`piece_layout`: each group of matrices one piece, which runs as one GEMM in
    `linear` or is used whole in `stacked`)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, layout: tuple[tuple[int, ...], ...]):
        params = list(module.parameters())
        self.flat = None
        casts = any(p.dtype != dtype for p in params)
        # Whether a group runs as one GEMM: always when cast (a group is then one piece of the
        # buffer); without a cast only in half precision (fp32 keeps nn.Linear's arithmetic).
        self.joins_groups = casts or dtype in (torch.bfloat16, torch.float16)
        if not casts:
            return
        pieces = [[params[i] for i in piece] for piece in layout]
        self.flat = torch.cat([p.reshape(-1) for piece in pieces for p in piece]).to(dtype)
        split = self.flat.split([sum(p.numel() for p in piece) for piece in pieces])
        self.views = []  # (a piece's first parameter, that piece shaped)
        for piece, values in zip(pieces, split):
            first = piece[0]
            shaped = values.view(first.shape) if len(piece) == 1 else values.view(-1, first.shape[-1])
            self.views.append((first, shaped))

    def _view(self, param: torch.Tensor) -> torch.Tensor:
        # matched by identity (`is`): dynamo resolves it without a guard on the parameter object
        for first, view in self.views:
            if first is param:
                return view
        raise KeyError(f"a parameter of shape {tuple(param.shape)} that is not one of this block's")

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        return param if self.flat is None else self._view(param)

    def stacked(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The matrices `params` one below the other: their group's piece of the cast buffer, or a
        concatenation of the parameters themselves when nothing is cast."""
        return torch.cat(params) if self.flat is None else self._view(params[0])

    def linear(self, x: torch.Tensor, *layers: nn.Linear) -> list[torch.Tensor]:
        """x @ W.T for the weight of each of `layers` (no biases): one GEMM for a group when cast
        or in half precision (`joins_groups`), else one each."""
        weights = [layer.weight for layer in layers]
        if not self.joins_groups or len(weights) == 1:
            return [F.linear(x, self(w)) for w in weights]
        return list(F.linear(x, self.stacked(weights)).split([w.shape[0] for w in weights], dim=-1))
