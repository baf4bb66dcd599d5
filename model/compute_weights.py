"""A block's parameters in the dtype its matmuls run in, cast together.

Under autocast to a dtype other than the parameters' (fp32 weights, bf16 compute), autocast casts
every weight at every GEMM and every norm weight promotes its bf16 input back to fp32, so that the
next GEMM casts it again. `ComputeWeights` casts all the parameters of a block in one go instead:
one concatenation and one cast per forward, one cast of their gradients in the backward. Weights
that sit next to each other in the block (q/k/v, gate/up) are then rows of one matrix of that
buffer, and `linear` runs them as one GEMM. The parameters themselves stay separate tensors,
so every weight format (MiniMind .pth, Qwen3 directories, GGUF, resume checkpoints) is unchanged.

Without a cast to make the parameters are used as they are, and a group of k weights runs as one
GEMM over their concatenation (`JoinedGemm`: `JoinedLinear` here, the MoE's `ExpertsGemm` in
feed_forward.py) or as k GEMMs on the same input, whichever `JoinedGemm.joins` picks. The
concatenation reads and writes the group's weights once more (2 x their elements); separate GEMMs
read the input k - 1 more times and, in a backward, sum k input gradients. A group is joined:
- where autograd records the GEMM (training): the backward's input gradient is then one GEMM
  instead of k GEMMs and a sum of k gradients. Forward and backward, separate GEMMs would move
  about 6 (k - 1) x (the input's elements) more, the concatenations 4 x (the weights'): more from
  about 500 tokens (q/k/v) and 3,200 (gate/up) on in the 768 x 8 layout, and a training batch
  has thousands;
- under torch.compile (the trainer's training and evaluation batches): a rule on the token count
  would be a guard, and batches on both sides of it would compile the block again;
- otherwise (generation, evaluation without torch.compile) where it moves fewer bytes:
  (k - 1) x (the input's elements) >= 2 x (the group's weight elements).
A decode step (one token per sequence) so runs separate GEMMs: joined, it would read and write
q/k/v and gate/up, about 2/3 of a block's weights, once more per new token, on top of the GEMMs'
own read of them (the `weights_kept` of a cast has no counterpart here: it would keep a second
copy of the weights). The separate GEMMs are `F.linear` on each weight, nn.Linear's arithmetic;
in fp32 every weight is its own GEMM always. The experts' grouped GEMM has its own rule (a
separate run costs their FLOPs times the number of experts: `ExpertsGemm.joins`).

The joined GEMMs' concatenation is not saved for the backward: they save their input and the
parameters themselves, eager or compiled, and their backward concatenates the weights again for
its GEMMs (one more copy per group, transient). So between a block's forward and its backward no
copy of its weights is kept beyond the parameters, which FSDP frees after the forward and gathers
again for the backward: a kept concatenation would hold q/k/v and gate/up (about 2/3 of a block's
weights; every expert's matrices in a MoE block) of every block, per rank, not divided by the
number of ranks. The gradients are autograd's own for the GEMM over the concatenation: the same
kernels on the same operands. With a cast the cast buffer is the one copy made anyway, and the
GEMMs save it as autocast's GEMMs save their cast weights.
"""

from __future__ import annotations

import contextlib

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
    `joined`)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, layout: tuple[tuple[int, ...], ...]):
        params = list(module.parameters())
        self.dtype, self.flat = dtype, None
        if all(p.dtype == dtype for p in params):
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

    def joins(self, gemm: type[JoinedGemm], a: torch.Tensor, params: list[torch.Tensor], *extra) -> bool:
        """Whether the group `params` runs as one GEMM of `gemm` (`joined`) on `a`: always with a cast
        (the group is one piece of the buffer), else where `gemm.joins` says (module docstring)."""
        return self.flat is not None or gemm.joins(a, params, *extra)

    def joined(self, gemm: type[JoinedGemm], a: torch.Tensor, params: list[torch.Tensor], *extra) -> torch.Tensor:
        """`gemm.of(a, W, *extra)` for W the matrices `params` (one group) one below the other: their
        piece of the cast buffer, or without a cast `gemm` joining the parameters themselves."""
        if self.flat is None:
            if not torch.is_grad_enabled():
                # Nothing to save for a backward (an evaluation): the GEMM itself. Dynamo (torch 2.13)
                # cannot trace these Functions' apply with grad disabled (the experts' concatenation
                # gets `ends` among the weights: a fake-tensor error).
                return gemm.forward(a, *extra, *params)
            return gemm.apply(a, *extra, *params)
        return gemm.of(a, self._view(params[0]), *extra)

    def linear(self, x: torch.Tensor, *layers: nn.Linear) -> list[torch.Tensor]:
        """x @ W.T for the weight of each of `layers` (no biases): one GEMM for a group where `joins`
        says, else one each."""
        weights = [layer.weight for layer in layers]
        if len(weights) > 1 and self.joins(JoinedLinear, x, weights):
            return list(per_weight(self.joined(JoinedLinear, x, weights), weights, dim=-1))
        return [F.linear(x, self(w)) for w in weights]


def block_weights(block: nn.Module, dtype: torch.dtype) -> ComputeWeights:
    """`block`'s `ComputeWeights` in `dtype` (its `weight_layout`): made at each forward, or once per
    dtype while `weights_kept` holds for it."""
    kept = block.kept_weights
    if kept is None:
        return ComputeWeights(block, dtype, block.weight_layout)
    if dtype not in kept:
        kept[dtype] = ComputeWeights(block, dtype, block.weight_layout)
    return kept[dtype]


@contextlib.contextmanager
def weights_kept(blocks):
    """While the weights do not change (generation), each of `blocks` casts them once and keeps that
    copy (as autocast keeps its casts within one autocast region), rather than at every forward: every
    new token's. Without a cast to make nothing is kept."""
    for block in blocks:
        block.kept_weights = {}
    try:
        yield
    finally:
        for block in blocks:
            block.kept_weights = None


def per_weight(joined: torch.Tensor, weights: list[torch.Tensor], dim: int = 0) -> tuple[torch.Tensor, ...]:
    """`joined`, a tensor over the rows of the matrices `weights` one below the other (their
    concatenation, its gradient, or a GEMM's output along `dim`), split into each weight's part (views)."""
    return joined.split([w.shape[0] for w in weights], dim=dim)


def save_inputs(ctx, inputs, output) -> None:
    """A `setup_context` that saves every tensor input for the backward."""
    ctx.save_for_backward(*inputs)


class JoinedGemm(torch.autograd.Function):
    """A GEMM `of(a, W, *extra)` over the matrices `weights` one below the other (W), called as
    `apply(a, *extra, *weights)`: it saves its inputs (a and the weights themselves, not W), and its
    backward joins the weights again, so that no copy of them outlives the forward (module
    docstring). A subclass defines `of`, a `forward` that runs it on `torch.cat(weights)`, a
    `backward` that hands its gradients to `returned`, and `joins`: whether parameters that need no
    cast run joined at all. Under torch.compile the backward's gradients are one custom op: traced,
    its concatenation would be the forward's (AOTAutograd merges equal expressions) and the
    forward would save it."""

    setup_context = staticmethod(save_inputs)

    @staticmethod
    def joins_anyway(a: torch.Tensor, weights: list[torch.Tensor]) -> bool:
        """Whether a group of parameters (no cast) is joined whatever its size: under torch.compile,
        and where autograd records the GEMM (module docstring). Neither adds a guard: dynamo guards
        the grad mode and every input's requires_grad already."""
        return torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and (a.requires_grad or any(w.requires_grad for w in weights)))

    @staticmethod
    def needs(ctx, weights: list[torch.Tensor]) -> tuple[bool, bool]:
        """Whether a needs its gradient, and whether any of the weights does."""
        return ctx.needs_input_grad[0], any(ctx.needs_input_grad[-len(weights):])

    @staticmethod
    def returned(ctx, weights: list[torch.Tensor], extra: int, gradients: list[torch.Tensor]) -> tuple:
        """The backward's result from `gradients` (a's where `needs` says, then W's where it says):
        a's, None for each of the `extra` inputs, then each weight's (views of W's)."""
        needs_a, needs_weights = JoinedGemm.needs(ctx, weights)
        grad_a = gradients[0] if needs_a else None
        per = per_weight(gradients[-1], weights) if needs_weights else (None,) * len(weights)
        return grad_a, *(None,) * extra, *per


def gradient_shapes(a: torch.Tensor, weights: list[torch.Tensor], needs_a: bool, needs_weights: bool) -> list:
    """A joined GEMM's gradients as its custom op returns them (a's, then W's, where needed), empty:
    the ops' fake implementation."""
    shapes = [a.new_empty(a.shape)] if needs_a else []
    if needs_weights:
        shapes.append(weights[0].new_empty(sum(w.shape[0] for w in weights), weights[0].shape[-1]))
    return shapes


def linear_gradients(grad: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], needs_x: bool,
                     needs_weights: bool) -> list[torch.Tensor]:
    """The gradients of F.linear(x, W), x's where `needs_x` and then W's where `needs_weights`: the
    GEMMs that autograd runs for them, with W joined again."""
    gradients = [grad.matmul(torch.cat(weights))] if needs_x else []
    if needs_weights:
        gradients.append(grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])))
    return gradients


linear_gradients_op = torch.library.custom_op("minisft::joined_linear_gradients", linear_gradients, mutates_args=())
linear_gradients_op.register_fake(lambda grad, x, weights, *needs: gradient_shapes(x, weights, *needs))


class JoinedLinear(JoinedGemm):
    """F.linear(x, W)."""

    of = staticmethod(F.linear)

    @staticmethod
    def joins(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
        """Without a cast: in half precision where `joins_anyway` says or where the concatenation moves
        fewer bytes than separate GEMMs, (k - 1) x.numel() >= 2 x the weights' elements (module
        docstring); never in fp32 (nn.Linear's arithmetic)."""
        if weights[0].dtype not in (torch.bfloat16, torch.float16):
            return False
        if JoinedGemm.joins_anyway(x, weights):
            return True
        return (len(weights) - 1) * x.numel() >= 2 * sum(w.numel() for w in weights)

    @staticmethod
    def forward(x, *weights):
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        gradients = linear_gradients_op if torch.compiler.is_compiling() else linear_gradients
        return JoinedGemm.returned(ctx, weights, 0, gradients(grad, x, weights, *JoinedGemm.needs(ctx, weights)))
