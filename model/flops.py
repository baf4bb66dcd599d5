"""Model FLOPs of training on a batch: the work that MFU (model FLOPs utilisation) divides by the time.

Forward and backward together cost three forwards, and a multiply-add is 2 FLOPs, so a micro-batch
costs ``6 * N_body * computed_tokens + 6 * hidden * vocab * logit_positions + 12 * layers * heads *
head_dim * causal_pairs``: ``N_body`` the parameters each token multiplies (every one but the
embedding table, a lookup, and the LM head; of a mixture-of-experts MLP its router and top-k
experts), over every position of the batch (pads too: the kernels compute them); the LM head at the
positions whose logits are computed; the attention's two products over the (query, key) pairs a
causal kernel computes, per row or per document of packed rows. Gradient checkpointing's second
forward is not model work and is not counted.
"""

from __future__ import annotations

import torch

from .feed_forward import MiniMindMoE
from .packed_attention import document_starts


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


def causal_pairs(batch: dict) -> int:
    """(query, key) pairs a causal kernel computes in `batch` (CPU tensors): per row, or per document
    of a packed row (the collator's `packed_layout`, else its `position_ids`)."""
    rows, length = batch["input_ids"].shape
    if "position_ids" not in batch:
        return rows * length * (length + 1) // 2
    layout = batch.get("packed_layout")
    lengths = layout.lengths if layout is not None else document_starts(batch["position_ids"])[1]
    return int((lengths * (lengths + 1) // 2).sum())


class ModelFlops:
    """The FLOPs of a model's training work (module docstring), its per-unit costs taken once."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.per_token = 6 * body_parameters(model)
        self.per_logit = 6 * config.hidden_size * config.vocab_size
        self.per_pair = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim

    def __call__(self, computed_tokens: int, logit_positions: int, pairs: int) -> int:
        return self.per_token * computed_tokens + self.per_logit * logit_positions + self.per_pair * pairs

    def of_batch(self, batch: dict, logit_positions: int) -> int:
        """A micro-batch's FLOPs, from its CPU tensors (no device value is read)."""
        return self(batch["input_ids"].numel(), logit_positions, causal_pairs(batch))


def model_flops(model: torch.nn.Module, computed_tokens: int, logit_positions: int, pairs: int) -> int:
    """FLOPs of forward + backward over this work (module docstring)."""
    return ModelFlops(model)(computed_tokens, logit_positions, pairs)


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak FLOP/s."""
    return flops / seconds / peak
