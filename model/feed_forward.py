"""The feed-forward half of a block: the SwiGLU MLP, and top-k routed experts (MoE) built from it."""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_minimind import MiniMindConfig


class MiniMindMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dropout: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MiniMindMoE(nn.Module):
    """Top-k routed experts with MiniMind's sequence-wise load-balancing loss.

    For every row s with n real tokens (pads excluded), E experts and k experts per token:
        balance_s = E / (k * n^2) * sum_e (slots of s routed to e) * (sum of e's router probs over s)
    = E * sum_e (fraction of s's slots on e) * (mean router prob of e over s); 1 for a perfectly
    balanced router, larger as routing collapses. `forward` returns coef * balance_s per row; a
    row is the unit, so how rows are split over micro-batches and ranks does not change the sum.

    Two dispatches with the same result: "gather" runs each expert on the tokens routed to it
    (the index lists have data-dependent sizes: free on the CPU, a host sync per expert on a
    GPU); "dense" runs each expert on every token and weights the output by the routing weight
    (0 where not routed): no sync, E/k times the expert FLOPs. `dispatch=None` picks "dense"
    on CUDA and "gather" elsewhere.
    """

    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_coef = config.router_aux_loss_coef
        self.dispatch: str | None = None
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MiniMindMLP(config.hidden_size, config.moe_intermediate_size, config.dropout)
            for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H]; token_mask [B, T] (1 = real token) or None. Returns (output, coef * balance [B])."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.gate(tokens).float().softmax(dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        dispatch = self.dispatch or ("dense" if tokens.is_cuda else "gather")
        if dispatch == "dense":
            out = self._dense(tokens, top_probs, top_experts)
        else:
            out = self._gather(tokens, top_probs, top_experts)
        return out.view(shape), self._balance(probs, top_experts, shape[0], token_mask)

    def _gather(self, tokens, top_probs, top_experts):
        out = torch.zeros_like(tokens)
        for expert_id, expert in enumerate(self.experts):
            token_idx, slot = (top_experts == expert_id).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            weight = top_probs[token_idx, slot].unsqueeze(-1).to(tokens.dtype)
            out.index_add_(0, token_idx, expert(tokens[token_idx]) * weight)
        return out

    def _dense(self, tokens, top_probs, top_experts):
        weights = torch.zeros(tokens.shape[0], self.num_experts, device=tokens.device, dtype=top_probs.dtype)
        weights = weights.scatter(1, top_experts, top_probs).to(tokens.dtype)  # [N, E], 0 = not routed
        out = torch.zeros_like(tokens)
        for expert_id, expert in enumerate(self.experts):
            out = out + expert(tokens) * weights[:, expert_id:expert_id + 1]
        return out

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
