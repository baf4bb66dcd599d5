"""Attention for packed rows without a [B, 1, T, T] mask.

A packed row holds several documents back to back; `position_ids` restart at 0 where a new one
begins. Each document must attend causally to itself only. A dense boolean mask says that, but
it costs T x T per row and keeps SDPA off its fused kernels. Instead the rows are flattened
to B x T tokens and each document is treated as a sequence of its own:

- CUDA, bf16/fp16, no dropout, where SDPA's FlashAttention runs (`flash_attention_dtype`: Ampere
  or newer): `torch.nn.attention.varlen.varlen_attn` (FlashAttention's variable-length kernel) on
  the flat tokens with cumulative document lengths;
- everywhere else: documents of similar length are gathered into small right-padded batches
  and run through SDPA with `is_causal=True`, one bucket at a time (model/packed_buckets.py; under
  torch.compile as one custom op, so that the compiled graph has no break there).

Both paths give the same result as the dense document mask: tests/model/test_packed_attention.py
checks the bucketed path against the eager reference, tests/test_cuda.py the varlen kernel against
the bucketed path (on a GPU). The layout is built on the CPU from `position_ids`, by the collator
(dataset/collate.py, where the batch already is) and handed to the model, so a CUDA forward
never waits for the GPU; it is shared by every layer. The buckets are planned with it, on the
CPU, and copied to the GPU only by the bucketed path, where it runs. A model called without it
builds it itself from `position_ids`, which on a GPU costs one host sync per forward.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch

from .compute_weights import compute_dtype
from .packed_buckets import attend_in_buckets_eagerly, bucketed_attention, plan_buckets, to_device

try:  # torch >= 2.10 (CUDA only at run time)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None


def document_starts(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [B, T] rows (CPU) flattened to B x T tokens: the flat index where each document
    starts and each document's length. A 0 starts a document, and so does every row."""
    batch, length = position_ids.shape
    starts_here = position_ids == 0
    starts_here[:, 0] = True  # a document never continues across rows
    starts = starts_here.reshape(-1).nonzero().squeeze(1)
    return starts, torch.diff(starts, append=torch.tensor([batch * length]))


class PackedDocuments:
    """Where the documents of packed [B, T] rows lie once the rows are flattened to B x T tokens.

    `starts`/`lengths` and the buckets' plan (`gather`, `bucket_shapes`, `rows`: `plan_buckets`)
    stay on the CPU; `cu_seqlens` lives on `device` (see `to`)."""

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, shape: tuple[int, int]):
        self.shape, self.device = tuple(shape), torch.device("cpu")
        self.starts, self.lengths = starts, lengths
        self.max_length = int(lengths.max()) if len(lengths) else 0
        self.cu_seqlens = torch.cat([starts, torch.tensor([shape[0] * shape[1]])]).to(torch.int32)
        self.gather, self.bucket_shapes, self.rows = plan_buckets(starts, lengths)

    @classmethod
    @torch.compiler.disable
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedDocuments:
        """The layout of packed rows; on a GPU tensor this waits for the GPU (one host sync)."""
        starts, lengths = document_starts(position_ids.detach().cpu())
        return cls(starts, lengths, position_ids.shape).to(position_ids.device)

    @classmethod
    def of_padded_rows(cls, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedDocuments | None:
        """The layout of rows whose pads (`attention_mask` 0) lie before and after one run of real
        tokens (a left-padded batch of prompts, right-padded rows), as the dense mask of the padding
        and the documents of `position_ids` has it: each pad a document of its own (it sees only
        itself), the real tokens documents by their positions, the first of them opening one. None
        for a row with pads between real tokens. On a GPU tensor one host sync."""
        both = torch.stack([attention_mask.detach().long(), position_ids.detach().expand_as(attention_mask)])
        real, positions = both.cpu()  # one copy
        real = real.bool()
        opens = real & ~torch.cat([real.new_zeros(real.shape[0], 1), real[:, :-1]], dim=1)
        if (opens.sum(dim=1) > 1).any():
            return None
        positions = torch.where(real & ~opens, positions, 0)
        return cls(*document_starts(positions), positions.shape).to(position_ids.device)

    def pin_memory(self) -> PackedDocuments:
        """A copy whose `cu_seqlens` and bucket indices (`gather`, `rows`) are in page-locked memory;
        a DataLoader with `pin_memory=True` calls this in its pinning thread, as it pins the batch's
        tensors. `bucket_shapes` is only read on the host."""
        pinned = copy.copy(self)
        pinned.cu_seqlens, pinned.gather, pinned.rows = (
            t.pin_memory() for t in (self.cu_seqlens, self.gather, self.rows))
        return pinned

    def to(self, device, non_blocking: bool = True) -> PackedDocuments:
        """A copy whose `cu_seqlens` is on `device` (an asynchronous host-to-device copy); the
        buckets' indices are copied where the bucketed path runs (`attend_in_buckets`); itself
        where it is there already (a layout moved to `cuda` is on `cuda:0`)."""
        device = torch.device(device)
        if device in (self.device, self.cu_seqlens.device):
            return self
        moved = copy.copy(self)
        moved.device = device
        moved.cu_seqlens = to_device(self.cu_seqlens, device) if non_blocking else self.cu_seqlens.to(device)
        return moved

    def attend(self, q, k, v, dropout: float) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D], causal within each document.
        Both paths trace under torch.compile without a graph break (the varlen kernel and the
        buckets are custom ops), the buckets with dropout excepted: they then run outside the graph."""
        batch, heads, length, head_dim = q.shape
        flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim) for t in (q, k, v)]
        half = flash_attention_dtype(q)
        if half is not None and dropout == 0.0 and _flash_varlen_available(q):
            out = causal_varlen_attn(*(t.to(half) for t in flat), self.cu_seqlens, self.max_length)
        else:
            out = self._attend_in_buckets(*flat, dropout)
        return out.view(batch, length, heads, head_dim).transpose(1, 2)

    def _attend_in_buckets(self, q, k, v, dropout: float) -> torch.Tensor:
        """`attend_in_buckets` in the compute dtype (autocast's, cast here as autocast would cast
        SDPA's inputs) with autocast off; under torch.compile without dropout as one op."""
        plan = (self.gather, self.bucket_shapes, self.rows)
        expand = gqa_needs_expanded_heads(q, k, masked=False)
        dtype = compute_dtype(q)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        with torch.autocast(q.device.type, enabled=False):
            if dropout == 0.0 and torch.compiler.is_compiling():
                return bucketed_attention(q, k, v, *plan, expand)[0]
            return attend_in_buckets_eagerly(q, k, v, *plan, expand, dropout)

    def dense(self) -> torch.Tensor:
        """The equivalent boolean [B, 1, T, T] mask (True = attend), for eager attention."""
        batch, length = self.shape
        ids = torch.zeros(batch * length, dtype=torch.long)
        ids[self.starts] = 1
        ids = to_device(ids.cumsum(0).view(batch, length), self.device)  # document number of every token
        same = ids.view(batch, 1, length, 1) == ids.view(batch, 1, 1, length)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        return same & causal


def causal_varlen_attn(q, k, v, cu_seqlens: torch.Tensor, max_length: int) -> torch.Tensor:
    """varlen_attn, causal within each document, on flat q [N, H, D] and k/v [N, H_kv, D], in the
    keywords this torch's varlen_attn takes: causality as `window_size=(-1, 0)` (or the older
    `is_causal=True`). The k/v heads go to the kernel as they are (FlashAttention 2 takes fewer
    k/v heads than q heads and sums their gradients itself), with `enable_gqa` where the signature
    has it; a signature with `window_size` and without `enable_gqa` checks no head count and runs
    FlashAttention only. The oldest signature, which may run cuDNN's kernel (no GQA), gets the k/v
    heads repeated up to q's."""
    if _varlen_takes("window_size"):
        options = {"window_size": (-1, 0)}
        if _varlen_takes("enable_gqa"):
            options["enable_gqa"] = True
    else:
        options = {"is_causal": True}
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **options)


@torch.compiler.assume_constant_result
def _varlen_takes(keyword: str) -> bool:
    """Whether the installed varlen_attn has this keyword (a constant to torch.compile)."""
    return keyword in _keywords_of(varlen_attn)


@functools.cache
def _keywords_of(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _flash_varlen_available(q: torch.Tensor) -> bool:
    """varlen_attn runs FlashAttention 2 where SDPA's flash kernel runs (`flash_attention_dtype`),
    with head_dim a multiple of 8 (SDPA pads other sizes; varlen_attn does not)."""
    return varlen_attn is not None and q.shape[-1] % 8 == 0


def gqa_needs_expanded_heads(q: torch.Tensor, k: torch.Tensor, masked: bool) -> bool:
    """Whether SDPA with GQA (fewer k/v heads than q heads) would fall back to its math kernel,
    which holds [B, H, T, S] scores: on CUDA only FlashAttention takes `enable_gqa` (the
    memory-efficient kernel does not), and it takes no explicit mask, no float32 and not every GPU
    or head size. The k/v heads are then repeated instead (memory of k/v times the group size, far
    less than the scores), which the memory-efficient kernel takes. CPU kernels take GQA."""
    return q.shape[1] != k.shape[1] and q.is_cuda and (masked or flash_attention_dtype(q) is None)


def flash_attention_dtype(q: torch.Tensor):
    """The half dtype in which FlashAttention runs this CUDA attention, or None where it cannot:
    float32, or a GPU, head size or setting its kernel does not take (SDPA's own check,
    `can_use_flash_attention`, asked once per device, dtype, head size and grad mode)."""
    half = _half_precision_dtype(q)
    if half is None:
        return None
    return half if _flash_runs(q.device.index, half, q.shape[-1], q.requires_grad and torch.is_grad_enabled()) else None


@torch.compiler.assume_constant_result
def _flash_runs(device_index: int | None, dtype: torch.dtype, head_dim: int, backward: bool) -> bool:
    """`_ask_sdpa_flash`, a constant to torch.compile."""
    return _ask_sdpa_flash(device_index, dtype, head_dim, backward)


@functools.cache
def _ask_sdpa_flash(device_index: int | None, dtype: torch.dtype, head_dim: int, backward: bool) -> bool:
    """SDPA's flash check on a causal GQA call of this kind: its rules depend on the GPU (sm80 and
    newer; head_dim up to 256, training on sm86/89/120 up to 192) and on the torch build."""
    with torch.cuda.device(device_index if device_index is not None else torch.cuda.current_device()):
        q = torch.zeros(1, 2, 8, head_dim, device="cuda", dtype=dtype, requires_grad=backward)
        kv = torch.zeros(1, 1, 8, head_dim, device="cuda", dtype=dtype, requires_grad=backward)
        params = torch.backends.cuda.SDPAParams(q, kv, kv, None, 0.0, True, True)
        return torch.backends.cuda.can_use_flash_attention(params, False)


def _half_precision_dtype(q: torch.Tensor):
    """bf16/fp16 if this CUDA attention runs in half precision (as a tensor or under autocast)."""
    if not q.is_cuda:
        return None
    if q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return dtype if dtype in (torch.float16, torch.bfloat16) else None
    return None
