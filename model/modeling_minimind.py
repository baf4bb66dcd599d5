"""The MiniMind decoder as a transformers model.

    token embedding
    N x [ RMSNorm -> GQA attention (q/k RMSNorm, RoPE, SDPA) -> + residual
          RMSNorm -> SwiGLU MLP (or top-k routed MoE)        -> + residual ]
    RMSNorm -> LM head (tied to the embedding)

Nothing here knows about training or distribution. Inputs the trainer relies on:
- `attention_mask` (1 = real token) for padded batches;
- `position_ids` that restart at 0 for every document of a packed row: a position of 0
  starts a new document and attention never crosses a document boundary;
- `labels` (unshifted, -100 = no loss) and optionally `num_items_in_batch`, the number of
  loss tokens the caller will average over (the loss is then a sum divided by it, so
  micro-batches and ranks can be combined exactly);
- `skip_logits=True` computes the LM head only where a label is set and returns no logits;
  the LM head + cross-entropy then run in chunks of tokens (`chunked_lm_loss`; without
  gradients `head_loss_in_chunks`), so a large vocabulary never holds [loss tokens x vocab]
  fp32 logits at once. With it,
  `return_token_losses=True` also returns every loss position's cross-entropy (`token_losses`,
  detached fp32, in `loss_positions` order): the trainer's per-source losses.

Precomputed by the collator (dataset/collate.py) on the CPU, so that a CUDA forward/backward
never waits for the GPU (no host sync); a caller that does not pass them gets them computed
here (one host sync each on a GPU):
- `loss_positions`: flat indices into the B x T tokens whose next token has a label
  (`loss_positions_of(labels)`);
- `packed_layout`: the documents of packed rows (`PackedDocuments`, packed_attention.py), on
  the CPU or on the model's device (copied there once per forward when on the CPU);
- `token_mask` (1 = real token): which tokens the MoE load-balancing loss counts (pads are
  excluded); without it `attention_mask` is used, or every token counts.
MoE load balancing is MiniMind's sequence-wise loss (one term per row, see `MiniMindMoE`),
summed over rows and divided by `num_sequences_in_batch` when given (else the number of rows
in the batch), so that micro-batches and ranks combine exactly like the token loss.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from .configuration_minimind import MiniMindConfig
from .compute_weights import ComputeWeights, block_weights, compute_dtype, piece_layout, weights_kept
from .feed_forward import MiniMindMLP, MiniMindMoE
from .loss import (IGNORE_INDEX, LOSS_CHUNK_ELEMENTS, chunked_lm_loss, cross_entropy_sum, head_loss_in_chunks,
                   loss_positions_of)
from .packed_attention import PackedDocuments, gqa_needs_expanded_heads
from .rope import apply_rope, precompute_rope_tables, rope_rows
from .rms_norm import MiniMindRMSNorm

@dataclass
class MiniMindCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` plus `token_losses` (see `return_token_losses`)."""

    token_losses: torch.FloatTensor | None = None


# --------------------------------------------------------------------------- blocks


class MiniMindAttention(nn.Module):
    def __init__(self, config: MiniMindConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.use_sdpa = config.flash_attn
        self.dropout = config.dropout
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = MiniMindRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = MiniMindRMSNorm(self.head_dim, config.rms_norm_eps)
        self.resid_dropout = nn.Dropout(config.dropout)

    def weight_groups(self) -> list[list[torch.Tensor]]:
        """q, k and v: one GEMM under autocast (`ComputeWeights`)."""
        return [[self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]]

    def forward(self, x, cos, sin, mask, past_key_values: Cache | None, weights: ComputeWeights):
        batch, length, _ = x.shape
        q, k, v = weights.linear(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.view(batch, length, self.num_heads, self.head_dim), weights(self.q_norm.weight))
        k = self.k_norm(k.view(batch, length, self.num_kv_heads, self.head_dim), weights(self.k_norm.weight))
        v = v.view(batch, length, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        dropout = self.dropout if self.training else 0.0
        if self.use_sdpa and mask.documents is not None:
            out = mask.documents.attend(q, k, v, dropout)  # packed rows, no dense mask
        elif self.use_sdpa:
            out = self._sdpa_attention(q, k, v, mask, dropout)
        else:
            out = self._eager_attention(q, k, v, mask, dropout)
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.resid_dropout(weights.linear(out, self.o_proj)[0])

    def _sdpa_attention(self, q, k, v, mask, dropout):
        """SDPA; `mask.allowed` is None for a plain causal block (the fast kernels) or a boolean
        [B,1,T,S]. Where SDPA would not take GQA (`gqa_needs_expanded_heads`), one new token (a decode
        step) runs its query heads as the query rows of their k/v head, so the cache is read as it is;
        longer queries repeat the k/v heads."""
        batch, heads, length, dim = q.shape
        if gqa_needs_expanded_heads(q, k, masked=mask.allowed is not None):
            groups = heads // k.shape[1]
            if length == 1 and not mask.is_causal:  # the [B,1,1,S] mask is the same for every row
                rows = q.reshape(batch, k.shape[1], groups, dim)
                out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask.allowed, dropout_p=dropout)
                return out.reshape(batch, heads, 1, dim)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.allowed, is_causal=mask.is_causal,
                                              dropout_p=dropout, enable_gqa=heads != k.shape[1])

    def _eager_attention(self, q, k, v, mask, dropout):
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        allowed = mask.dense(q.shape[-2], k.shape[-2], q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = F.dropout(scores.float().softmax(-1).to(q.dtype), p=dropout, training=dropout > 0)
        return weights @ v


class MiniMindBlock(GradientCheckpointingLayer):
    def __init__(self, config: MiniMindConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = MiniMindRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MiniMindAttention(config, layer_idx)
        self.post_attention_layernorm = MiniMindRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.use_moe = config.use_moe
        if config.use_moe:
            self.mlp = MiniMindMoE(config)
        else:
            self.mlp = MiniMindMLP(config.hidden_size, config.intermediate_size, config.dropout)
        self.weight_layout = piece_layout(self, self.self_attn.weight_groups() + self.mlp.weight_groups())
        self.kept_weights = None  # `weights_kept`: the cast weights kept while generating

    def forward(self, hidden, cos, sin, mask, past_key_values=None, token_mask=None):
        """hidden (the residual stream), cos and sin in the compute dtype (`compute_dtype`)."""
        weights = block_weights(self, hidden.dtype)
        normed = self.input_layernorm(hidden, weights(self.input_layernorm.weight))
        hidden = hidden + self.self_attn(normed, cos, sin, mask, past_key_values, weights)
        normed = self.post_attention_layernorm(hidden, weights(self.post_attention_layernorm.weight))
        if self.use_moe:
            mlp_out, aux = self.mlp(normed, weights, token_mask)
        else:
            mlp_out, aux = self.mlp(normed, weights), None
        return hidden + mlp_out, aux


# --------------------------------------------------------------------------- masks


class AttentionMask:
    """Which keys each query may see.

    Three forms: `documents` set = packed rows, causal within each document (see
    packed_attention.py; no dense mask is built unless eager attention asks for one);
    `allowed is None` = plain causal, so SDPA can use its fused causal kernels; otherwise
    `allowed` is a boolean [B, 1, T, S] tensor (True = attend).
    """

    def __init__(self, allowed: torch.Tensor | None, is_causal: bool, documents: PackedDocuments | None = None):
        self.allowed, self.is_causal, self.documents = allowed, is_causal, documents

    def dense(self, q_len: int, k_len: int, device) -> torch.Tensor:
        if self.documents is not None:
            return self.documents.dense()
        if self.allowed is not None:
            return self.allowed
        offset = k_len - q_len
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=offset)

    @classmethod
    def build(cls, batch, q_len, past_len, attention_mask, position_ids, packed, device, packed_layout=None):
        """`packed`: position_ids came from the caller with no cache, so a 0 opens a document
        (`packed_layout`: the documents, precomputed by the caller, on the CPU or on `device`
        already; the varlen kernel reads its `cu_seqlens` on `device`)."""
        if packed and attention_mask is not None and packed_layout is None:  # generation's padded prompts
            packed_layout = PackedDocuments.of_padded_rows(position_ids, attention_mask[:, -q_len:])
            attention_mask = None if packed_layout is not None else attention_mask
        if packed and attention_mask is None:
            if packed_layout is None:
                packed_layout = PackedDocuments.from_position_ids(position_ids)
            return cls(None, is_causal=False, documents=packed_layout.to(device))
        document_ids = (position_ids == 0).long().cumsum(dim=-1) if packed else None
        if attention_mask is None and document_ids is None:
            if past_len == 0:
                # (a branch, not `q_len > 1`, so that torch.compile with dynamic shapes passes a plain bool)
                return cls(None, is_causal=True if q_len > 1 else False)
            if q_len == 1:
                return cls(None, is_causal=False)  # one new token sees the whole cache
        k_len = past_len + q_len
        q_pos = torch.arange(past_len, k_len, device=device).view(-1, 1)
        k_pos = torch.arange(k_len, device=device).view(1, -1)
        allowed = (k_pos <= q_pos).view(1, 1, q_len, k_len).expand(batch, 1, q_len, k_len)
        if attention_mask is not None:
            keys = attention_mask[:, -k_len:].bool().view(batch, 1, 1, k_len)
            allowed = allowed & keys
        if document_ids is not None:
            same_doc = document_ids.view(batch, 1, q_len, 1) == document_ids.view(batch, 1, 1, q_len)
            allowed = allowed & same_doc
        # Every query keeps itself, so a padding query never has an all-masked row (NaN).
        allowed = allowed | (k_pos == q_pos).view(1, 1, q_len, k_len)
        return cls(allowed, is_causal=False)


# --------------------------------------------------------------------------- models


class MiniMindPreTrainedModel(PreTrainedModel):
    config_class = MiniMindConfig
    config: MiniMindConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MiniMindBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        # transformers releases that name it gradient_checkpointing_enable (5.17 among them)
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs):
            self.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MiniMindRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MiniMindModel):
            # Non-persistent buffers are never loaded from a checkpoint: rebuild them here,
            # which also covers models that transformers first creates on the meta device.
            cos, sin = precompute_rope_tables(self.config, device=module.freqs_cos.device)
            init.copy_(module.freqs_cos, cos)
            init.copy_(module.freqs_sin, sin)


class MiniMindModel(MiniMindPreTrainedModel):
    def __init__(self, config: MiniMindConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(MiniMindBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = MiniMindRMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = precompute_rope_tables(config)
        # Derived from the config, never trained, never saved, never synced by DDP.
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        self.gradient_checkpointing = False
        self.post_init()

    def _apply(self, fn, recurse=True):
        # A `.to(bfloat16)` of the model must not round the RoPE tables: keep them fp32
        # (recomputed on the new device, so they equal a fresh computation bit for bit).
        super()._apply(fn, recurse)
        if self.freqs_cos.dtype != torch.float32:
            cos, sin = precompute_rope_tables(self.config, device=self.freqs_cos.device)
            self.freqs_cos, self.freqs_sin = cos, sin
        return self

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        packed_layout: PackedDocuments | None = None,
        token_mask: torch.Tensor | None = None,
        num_sequences_in_batch: int | torch.Tensor | None = None,
    ):
        """Returns (final hidden states, MoE balance loss, cache). The balance loss is the sum of
        every layer's per-row terms over the rows, divided by `num_sequences_in_batch` (default:
        the rows of this batch that have a real token); 0 for a dense model."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("MiniMindModel: pass exactly one of input_ids or inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, q_len = hidden.shape[:2]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if getattr(past_key_values, "is_compileable", False):  # transformers' StaticCache and its kin
            raise ValueError("MiniMindModel: a static KV cache (cache_implementation='static') is not supported: "
                             "its keys span the whole cache, not the tokens seen; use the default dynamic cache")
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0

        packed = position_ids is not None and past_len == 0
        if position_ids is None:
            if attention_mask is not None:
                # Left-padded generation: count only real tokens.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]
            else:
                position_ids = torch.arange(past_len, past_len + q_len, device=hidden.device)
                position_ids = position_ids.unsqueeze(0).expand(batch, -1)
        if past_len + q_len > self.config.max_position_embeddings:
            raise ValueError(
                f"MiniMindModel: sequence of {past_len + q_len} tokens exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        mask = AttentionMask.build(batch, q_len, past_len, attention_mask, position_ids, packed, hidden.device,
                                   packed_layout)
        # The residual stream and the RoPE rows in the compute dtype, cast once for all the layers.
        dtype = compute_dtype(hidden)
        hidden = hidden.to(dtype)
        cos, sin = rope_rows(self.freqs_cos, self.freqs_sin, position_ids, dtype)
        if token_mask is None and attention_mask is not None:
            token_mask = attention_mask[:, -q_len:]

        hidden = self.dropout(hidden)
        balance = hidden.new_zeros(batch, dtype=torch.float32)  # per row, summed over the MoE layers
        for layer in self.layers:
            hidden, aux = layer(hidden, cos, sin, mask, past_key_values, token_mask=token_mask)
            if aux is not None:
                balance = balance + aux
        if num_sequences_in_batch is None:
            num_sequences_in_batch = token_mask.bool().any(dim=-1).sum().clamp(min=1) if token_mask is not None else batch
        return self.norm(hidden), balance.sum() / num_sequences_in_batch, past_key_values


class MiniMindForCausalLM(MiniMindPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # skip_logits' training loss in chunks (chunked_lm_loss); False = all loss positions' logits at once
    # (the reference the tests and scripts/bench.py's "unchunked" mode compare against).
    chunk_lm_loss = True

    def __init__(self, config: MiniMindConfig):
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        skip_logits: bool = False,
        loss_positions: torch.LongTensor | None = None,
        packed_layout: PackedDocuments | None = None,
        token_mask: torch.Tensor | None = None,
        num_sequences_in_batch: int | torch.Tensor | None = None,
        return_token_losses: bool = False,
        **kwargs,
    ) -> MiniMindCausalLMOutput:
        """Causal LM forward.

        loss: shifted cross-entropy over labels != -100, the mean over those tokens, or their
        sum divided by `num_items_in_batch` when given. `aux_loss` (MoE load balancing, already
        multiplied by `router_aux_loss_coef`; 0 for a dense model) is returned separately.
        With `skip_logits` the loss is computed from `loss_positions` (computed here if not
        given) in chunks, and no logits are returned; `return_token_losses` then adds each loss
        position's cross-entropy, unscaled and detached (`token_losses`, in `loss_positions` order).
        """
        hidden, aux_loss, past_key_values = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            packed_layout=packed_layout,
            token_mask=token_mask,
            num_sequences_in_batch=num_sequences_in_batch,
        )
        logits, loss, token_losses = None, None, None
        if return_token_losses and not (skip_logits and labels is not None):
            raise ValueError("return_token_losses needs labels and skip_logits=True")
        if labels is not None:
            if skip_logits:
                if loss_positions is None:
                    loss_positions = loss_positions_of(labels)
                targets = labels.reshape(-1)[loss_positions + 1]  # the next token of the same row
                chosen = hidden.reshape(-1, hidden.shape[-1]).index_select(0, loss_positions)
                count = num_items_in_batch if num_items_in_batch is not None else max(len(targets), 1)
                if self.chunk_lm_loss and torch.is_grad_enabled():
                    total = chunked_lm_loss(chosen, self.lm_head.weight, targets, self.loss_chunk_tokens(),
                                            token_losses=return_token_losses)
                    if return_token_losses:
                        total, token_losses = total
                else:
                    # Without gradients (evaluation) nothing is kept for a backward: the head is called
                    # once per chunk of loss positions, so that hooks on it see their logits
                    # (trainer/evaluation/evaluate.py); unchunked, once on all of them.
                    chunk = self.loss_chunk_tokens() if self.chunk_lm_loss else max(len(targets), 1)
                    total, token_losses = head_loss_in_chunks(self.lm_head, chosen, targets, chunk,
                                                              token_losses=return_token_losses)
                loss = total / count
            else:
                logits = self.lm_head(hidden)
                loss = self._reduce_loss(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), num_items_in_batch
                )
        if logits is None and not skip_logits:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden[:, keep])
        return MiniMindCausalLMOutput(
            loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=past_key_values if use_cache else None,
            token_losses=token_losses if return_token_losses else None,
        )

    def generate(self, *args, **kwargs):
        """GenerationMixin's, with each block's cast weights made once for all the new tokens."""
        with weights_kept(self.model.layers):
            return super().generate(*args, **kwargs)

    def loss_chunk_tokens(self) -> int:
        """Tokens per chunk of the LM loss: LOSS_CHUNK_ELEMENTS fp32 logits at a time."""
        return max(1, LOSS_CHUNK_ELEMENTS // self.config.vocab_size)

    @staticmethod
    def _reduce_loss(logits, targets, num_items_in_batch):
        total = cross_entropy_sum(logits, targets)
        if num_items_in_batch is None:
            num_items_in_batch = (targets != IGNORE_INDEX).sum().clamp(min=1)
        return total / num_items_in_batch
