"""The feed-forward half of a block: the SwiGLU MLP, and top-k routed experts (MoE) built from it."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .compute_weights import ComputeWeights, JoinedGemm, JoinedLinear, gradient_shapes, save_inputs
from .configuration_minimind import MiniMindConfig


class MiniMindMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dropout: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def weight_groups(self) -> list[list[torch.Tensor]]:
        """gate and up: one GEMM under autocast (`ComputeWeights`)."""
        return [[self.gate_proj.weight, self.up_proj.weight]]

    def forward(self, x: torch.Tensor, weights: ComputeWeights) -> torch.Tensor:
        """`weights`: the enclosing block's parameters in the compute dtype (gate and up: one GEMM)."""
        gate_up = [self.gate_proj.weight, self.up_proj.weight]
        if weights.joins(JoinedLinear, x, gate_up):
            hidden = swiglu(weights.joined(JoinedLinear, x, gate_up))
        else:
            gate, up = weights.linear(x, self.gate_proj, self.up_proj)
            hidden = F.silu(gate) * up
        return self.dropout(weights.linear(hidden, self.down_proj)[0])


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of one [..., 2I] GEMM output, gate first. Its gradient is one [..., 2I]
    tensor whose halves the two products write, where autograd's backward of a split would
    concatenate them (a pass over the widest activation of the block); the same products as
    autograd's, bit for bit. Under torch.compile the expression itself (inductor fuses it; Dynamo
    does not trace the strided `out=` writes). Its gradient is not differentiable again (an `out=`
    write records no graph): `create_graph=True` gets first-order gradients, a second order an error."""
    if torch.compiler.is_compiling():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(gate_up)


class _SwiGLU(torch.autograd.Function):
    """Saves gate_up only: silu(gate), which up's gradient multiplies, is computed again in the
    backward (the same kernel on the same values, so the same bits) rather than kept from the forward
    to the backward, [..., I] per token per block (a third of what the MLP saves)."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, F.silu(gate), out=grad_up)
        return grad_gate_up


class MiniMindMoE(nn.Module):
    """Top-k routed experts with MiniMind's sequence-wise load-balancing loss.

    For every row s with n real tokens (pads excluded), E experts and k experts per token:
        balance_s = E / (k * n^2) * sum_e (slots of s routed to e) * (sum of e's router probs over s)
    = E * sum_e (fraction of s's slots on e) * (mean router prob of e over s); 1 for a perfectly
    balanced router, larger as routing collapses. `forward` returns coef * balance_s per row; a
    row is the unit, so how rows are split over micro-batches and ranks does not change the sum.

    Dispatch: the token slots (token, chosen expert) are sorted by expert, so that each expert's
    tokens lie next to each other, and every expert runs on its own tokens only: one grouped GEMM
    for gate/up of all the experts and one for down (`F.grouped_mm`, the group ends on the
    device), k/E of the FLOPs of running every expert on every token. PyTorch's grouped kernel, which
    reads nothing on the host, serves CUDA GPUs of compute capability 9.x or 10.x (H100, H200, B200)
    with bf16 operands and output. Everywhere else (the CPU, other GPUs such as A100 or RTX 50xx,
    float16 or float32 operands) its fallback copies the group ends to the host, a sync on a GPU,
    and loops over the groups. Under torch.compile see `grouped_mm`. Without a cast and without a
    backward, a few slots (a decode step) run one GEMM per expert matrix on every slot instead,
    where the grouped GEMM would concatenate every expert's weights first (`ExpertsGemm.joins`).
    """

    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MiniMindMLP(config.hidden_size, config.moe_intermediate_size, config.dropout)
            for _ in range(config.num_experts)
        )
        self.dropout = nn.Dropout(config.dropout)  # on every expert's output, as in MiniMindMLP

    def weight_groups(self) -> list[list[torch.Tensor]]:
        """Every expert's gate and up, and every expert's down: one piece each under autocast."""
        return [[w for e in self.experts for w in (e.gate_proj.weight, e.up_proj.weight)],
                [e.down_proj.weight for e in self.experts]]

    def forward(self, x: torch.Tensor, weights: ComputeWeights,
                token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H]; `weights`: the block's parameters in the compute dtype; token_mask [B, T]
        (1 = real token) or None. Returns (output, coef * balance [B])."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = weights.linear(tokens, self.gate)[0].float().softmax(dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        out = self._experts(tokens, top_probs, top_experts, weights)
        return out.view(shape), self._balance(probs, top_experts, shape[0], token_mask)

    def _experts(self, tokens, top_probs, top_experts, weights: ComputeWeights) -> torch.Tensor:
        """sum over each token's k slots of routing weight x its expert's MLP of the token. The slots
        go to expert order and back by writes to distinct rows, whose gradients are gathers, and a
        token's k weighted slots are summed by a reduction (fp32 accumulation, one rounding): no
        atomic adds (`index_add_` on a GPU adds in any order), the same bits on every run and device."""
        count, hidden = tokens.shape
        slot_experts = top_experts.reshape(-1)  # [N * k], slot s belongs to token s // k
        order = slot_experts.argsort(stable=True)  # row i of the expert order holds slot order[i]
        # and slot s is its row slot_rows[s] (the inverse permutation, without a second sort)
        slot_rows = torch.empty_like(order).index_put_((order,), torch.arange(order.numel(), device=order.device))
        experts = torch.arange(self.num_experts, device=tokens.device)
        ends = (slot_experts.unsqueeze(1) == experts).sum(dim=0).cumsum(dim=0).to(torch.int32)
        gate_up = [w for e in self.experts for w in (e.gate_proj.weight, e.up_proj.weight)]
        down = [e.down_proj.weight for e in self.experts]
        # grouped_mm has no autocast rule on every torch (2.11 CUDA): the tokens take the weights' dtype here
        sorted_tokens = tokens.new_empty(order.numel(), hidden, dtype=weights.dtype).index_put_(
            (slot_rows.view(count, self.top_k),), tokens.unsqueeze(1).to(weights.dtype))
        gated = swiglu(experts_gemm(weights, sorted_tokens, gate_up, ends))
        expert_out = self.dropout(experts_gemm(weights, gated, down, ends))
        slot_out = torch.empty_like(expert_out).index_put_((order,), expert_out).view(count, self.top_k, hidden)
        # dtype given: CUDA autocast keeps it (it runs a sum without one in float32)
        return (slot_out * top_probs.unsqueeze(-1).to(slot_out.dtype)).sum(dim=1, dtype=slot_out.dtype)

    def _balance(self, probs, top_experts, rows, token_mask):
        """coef * balance_s for every row s (0 for a row without real tokens)."""
        experts = torch.arange(self.num_experts, device=probs.device)
        routed = (top_experts.unsqueeze(-1) == experts).sum(dim=1).float()  # [N, E] slots per expert
        if token_mask is not None:
            real = token_mask.reshape(-1, 1).to(probs.dtype)
            routed, probs = routed * real, probs * real
        slots = routed.view(rows, -1, self.num_experts).sum(dim=1)  # [B, E]
        prob_sums = probs.view(rows, -1, self.num_experts).sum(dim=1)
        n = slots.sum(dim=-1) / self.top_k  # real tokens per row
        balance = (slots * prob_sums).sum(dim=-1) * self.num_experts / (self.top_k * n.clamp(min=1) ** 2)
        return self.aux_coef * balance


def grouped_mm(tokens: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`F.grouped_mm(tokens, weights, offs=ends)`: tokens [N, K] sorted by group, weights [G, K, M],
    ends the int32 cumulative group sizes [G] -> [N, M]. torch.compile traces `aten._grouped_mm`
    with a shape function that takes bf16 operands only, while the kernel runs every float dtype
    (float32 on the CPU, float16 on a V100 or T4): under torch.compile those other dtypes go
    through the custom op `minisft::grouped_mm` (eager's kernel, forward and backward, opaque to
    inductor), and bf16 stays aten's op, which inductor lowers itself. The custom op also takes
    operands the kernel refuses as they are laid out (`kernel_takes`: e.g. a hidden size that is not
    a multiple of 8 in bf16) or whose output rows it would refuse as the gradient in aten's backward:
    it hands the kernel copies it takes (`kernel_operand`), forward and backward."""
    output_row = weights.shape[-1] * weights.element_size()
    laid_out = kernel_takes(tokens) and kernel_takes(weights) and output_row % GROUPED_MM_ALIGNMENT == 0
    if not laid_out or (torch.compiler.is_compiling() and tokens.dtype != torch.bfloat16):
        return grouped_mm_op(tokens, weights, ends)
    return F.grouped_mm(tokens, weights, offs=ends)


# Bytes: the grouped GEMM kernels (CPU and CUDA) take an operand whose rows (or columns) lie a multiple
# of this apart; the CUDA kernel also needs its first element at an address that is a multiple of it.
GROUPED_MM_ALIGNMENT = 16


def kernel_takes(operand: torch.Tensor) -> bool:
    """Whether the grouped GEMM takes `operand` as it is: one of its last two dimensions contiguous,
    the other's stride a multiple of GROUPED_MM_ALIGNMENT bytes, and its first element a multiple of
    that many bytes into its storage (whose own start the allocators align further). Under
    torch.compile the strides only (a traced tensor's offset is not known): the model's operands start
    at such a multiple wherever their strides are one, as its cast buffer puts the grouped pieces first."""
    rows, columns = operand.stride(-2), operand.stride(-1)
    step = rows if columns == 1 else columns if rows == 1 else None
    size = operand.element_size()
    if step is None or (step * size) % GROUPED_MM_ALIGNMENT:
        return False
    return torch.compiler.is_compiling() or (operand.storage_offset() * size) % GROUPED_MM_ALIGNMENT == 0


def kernel_operand(operand: torch.Tensor) -> torch.Tensor:
    """`operand` itself where the grouped GEMM takes it, else a copy with the same values and shape
    whose rows are padded to GROUPED_MM_ALIGNMENT bytes (a view of the padded copy)."""
    if kernel_takes(operand):
        return operand
    width = operand.shape[-1]
    padding = -width % (GROUPED_MM_ALIGNMENT // operand.element_size())
    if padding == 0:  # rows already a multiple apart once contiguous, or contiguous at an odd address
        return operand.clone(memory_format=torch.contiguous_format)
    return F.pad(operand, (0, padding))[..., :width]


def grouped_mm_of_copies(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`F.grouped_mm(a, b, offs=ends)` for a [N, K] with b [G, K, M] (-> [N, M]) or b [N, M]
    (-> [G, K, M], the weights' gradient), contiguous (a CUDA build pads the rows of its output
    to 16 bytes; the op's shapes below promise a contiguous one). Operands the kernel does not
    take as they are laid out go to it as `kernel_operand` copies. The body of `grouped_mm_op`."""
    return F.grouped_mm(kernel_operand(a), kernel_operand(b), offs=ends).contiguous()


grouped_mm_op = torch.library.custom_op("minisft::grouped_mm", grouped_mm_of_copies, mutates_args=())


@grouped_mm_op.register_fake
def _grouped_mm_shapes(a, b, ends):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_backward(ctx, grad):
    a, b, ends = ctx.saved_tensors
    return *grouped_mm_gradients(grad, a, b, ends, ctx.needs_input_grad, grouped_mm_op), None


def grouped_mm_gradients(grad, a, b, ends, needs: tuple[bool, bool], gemm) -> tuple:
    """aten's own gradients of `_grouped_mm(a, b, offs=ends)` (its autograd formula) where `needs`
    says, each one grouped GEMM `gemm`; the output's gradient made contiguous (a no-op for the
    MoE's), as the kernel takes only strides aligned to 16 bytes and an expanded gradient (that of
    a sum) has none."""
    grad = grad.contiguous()
    grad_a = gemm(grad, b.mT, ends) if needs[0] else None
    grad_b = gemm(grad.mT, a, ends).mT if needs[1] else None
    return grad_a, grad_b


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=save_inputs)


def experts_gemm(weights: ComputeWeights, a: torch.Tensor, params: list[torch.Tensor],
                 ends: torch.Tensor) -> torch.Tensor:
    """`ExpertsGemm.of(a, W, ends)` for W the experts' matrices `params` one below the other: one
    grouped GEMM where `weights.joins` says, else `ExpertsGemm.separate`."""
    if weights.joins(ExpertsGemm, a, params, ends):
        return weights.joined(ExpertsGemm, a, params, ends)
    return ExpertsGemm.separate(a, params, ends)


# Most rows (routed token slots) whose experts run as separate GEMMs without a cast: see ExpertsGemm.joins.
SEPARATE_EXPERTS_MAX_ROWS = 64


class ExpertsGemm(JoinedGemm):
    """`grouped_mm(a, experts, ends)` for `experts` the [G, K, M] transposes of W's G equal blocks of
    rows ([G * M, K]: each expert's matrices one below the other, experts in order)."""

    @staticmethod
    def joins(a: torch.Tensor, weights: list[torch.Tensor], ends: torch.Tensor) -> bool:
        """Without a cast (any dtype: the grouped GEMM takes one [G, K, M] tensor): where `joins_anyway`
        says, or over more than SEPARATE_EXPERTS_MAX_ROWS rows. Up to that (a decode step of up to
        64 / k sequences) `separate` runs every expert on every row: G times the grouped GEMM's FLOPs,
        but a GEMM of r rows does r FLOPs per byte of its bf16 weights, fewer than a GPU computes in
        the time it reads a byte (about 150 on an A100, 300 on an H100), so each is bound by reading
        its weights: every expert's once, where the concatenation reads and writes every expert's
        once more and the grouped GEMM then reads the routed ones. With more rows the G times FLOPs
        would cost more than the concatenation. (In fp32, r / 2 FLOPs per byte: about even at 64
        rows on an A100 without TF32, which computes some 10 per byte.)"""
        return JoinedGemm.joins_anyway(a, weights) or a.shape[0] > SEPARATE_EXPERTS_MAX_ROWS

    @staticmethod
    def separate(a: torch.Tensor, weights: list[torch.Tensor], ends: torch.Tensor) -> torch.Tensor:
        """`of(a, W, ends)` without W: `F.linear` of every row with each of the weights, then each row's
        own expert's (its group in `ends`, found on the device: no host sync). The same products as
        the grouped GEMM's, row by row."""
        rows = torch.arange(a.shape[0], device=a.device, dtype=ends.dtype)
        expert = torch.searchsorted(ends, rows, right=True)
        products = torch.stack([F.linear(a, w) for w in weights])  # [G * m, rows, M]: expert e's at e*m..
        per_expert = products.view(ends.shape[0], -1, *products.shape[1:])  # [G, m, rows, M]
        return per_expert[expert, :, rows].flatten(1)  # [rows, m * M], each expert's matrices in order

    @staticmethod
    def experts(joined: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return joined.view(ends.shape[0], -1, joined.shape[-1]).transpose(1, 2)

    @staticmethod
    def of(a, joined, ends):
        return grouped_mm(a, ExpertsGemm.experts(joined, ends), ends)

    @staticmethod
    def forward(a, ends, *weights):
        return ExpertsGemm.of(a, torch.cat(weights), ends)

    @staticmethod
    def backward(ctx, grad):
        a, ends, *weights = ctx.saved_tensors
        gradients = experts_gradients_op if torch.compiler.is_compiling() else experts_gradients
        return JoinedGemm.returned(ctx, weights, 1, gradients(grad, a, weights, ends, *JoinedGemm.needs(ctx, weights)))


def experts_gradients(grad: torch.Tensor, a: torch.Tensor, weights: list[torch.Tensor], ends: torch.Tensor,
                      needs_a: bool, needs_weights: bool) -> list[torch.Tensor]:
    """The gradients of `ExpertsGemm`, a's where `needs_a` and then W's where `needs_weights`: aten's
    for its grouped GEMM (`grouped_mm_gradients`), with W joined again; contiguous, as the fake
    implementation of the custom op says (a no-op for the MoE's)."""
    experts = ExpertsGemm.experts(torch.cat(weights), ends)
    grad_a, grad_experts = grouped_mm_gradients(grad, a, experts, ends, (needs_a, needs_weights), grouped_mm)
    grad_joined = None if grad_experts is None else grad_experts.mT.flatten(0, 1)
    return [gradient.contiguous() for gradient in (grad_a, grad_joined) if gradient is not None]


experts_gradients_op = torch.library.custom_op("minisft::experts_gradients", experts_gradients, mutates_args=())
experts_gradients_op.register_fake(lambda grad, a, weights, ends, *needs: gradient_shapes(a, weights, *needs))
