"""Attention for packed rows without a [B, 1, T, T] mask.

A packed row holds several documents back to back; `position_ids` restart at 0 where a new one
begins. Each document must attend causally to itself only. A dense boolean mask says that, but
it costs T x T per row and keeps SDPA off its fused kernels. Instead the rows are flattened
to B x T tokens and each document is treated as a sequence of its own:

- CUDA, bf16/fp16, no dropout, where SDPA's FlashAttention runs (`flash_attention_dtype`: Ampere
  or newer): `torch.nn.attention.varlen.varlen_attn` (FlashAttention's variable-length kernel) on
  the flat tokens with cumulative document lengths;
- everywhere else: documents of similar length (same power-of-two bucket) are gathered into a
  small [n, L, heads, head_dim] batch, right-padded, and run through SDPA with `is_causal=True`.
  The padding sits after every real token, so causal attention never lets a real token see it;
  a bucket pads a document to at most twice its length.

Both paths give the same result as the dense document mask: tests/model/test_packed_attention.py
checks the bucketed path against the eager reference, tests/test_cuda.py the varlen kernel against
the bucketed path (on a GPU). The layout is built on the CPU from `position_ids`, by the collator
(dataset/collate.py, where the batch already is) and handed to the model, so a CUDA forward
never waits for the GPU; it is shared by every layer (the SDPA buckets are built only when that
path runs, on the CPU too). A model called without it builds it itself from `position_ids`,
which on a GPU costs one host sync per forward.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
import torch.nn.functional as F

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

    `starts`/`lengths` stay on the CPU (the buckets are planned there); `cu_seqlens` and the
    bucket indices live on `device` (see `to`)."""

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, shape: tuple[int, int]):
        self.shape, self.device = tuple(shape), torch.device("cpu")
        self.starts, self.lengths = starts, lengths
        self.max_length = int(lengths.max()) if len(lengths) else 0
        self.cu_seqlens = torch.cat([starts, torch.tensor([shape[0] * shape[1]])]).to(torch.int32)

    @classmethod
    @torch.compiler.disable
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedDocuments:
        """The layout of packed rows; on a GPU tensor this waits for the GPU (one host sync)."""
        starts, lengths = document_starts(position_ids.detach().cpu())
        return cls(starts, lengths, position_ids.shape).to(position_ids.device)

    def pin_memory(self) -> PackedDocuments:
        """A copy whose `cu_seqlens` is in page-locked memory; a DataLoader with `pin_memory=True`
        calls this in its pinning thread, as it pins the batch's tensors."""
        pinned = copy.copy(self)
        pinned.__dict__.pop("buckets", None)
        pinned.cu_seqlens = self.cu_seqlens.pin_memory()
        return pinned

    def to(self, device, non_blocking: bool = True) -> PackedDocuments:
        """A copy whose device tensors are on `device` (asynchronous host-to-device copies)."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = copy.copy(self)
        moved.__dict__.pop("buckets", None)  # planned again for the new device when needed
        moved.device = device
        moved.cu_seqlens = to_device(self.cu_seqlens, device) if non_blocking else self.cu_seqlens.to(device)
        return moved

    @functools.cached_property
    def buckets(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """For the SDPA path only: ([gather index [n, L] of each bucket], the rows of the buckets'
        padded outputs, flattened one after the other, that hold each token's output, in token order)."""
        starts, lengths, device = self.starts, self.lengths, self.device
        # Power-of-two buckets: (0, 1], (1, 2], (2, 4], ... so padding at most doubles a document.
        bucket_of = torch.ceil(torch.log2(lengths.double())).long()
        buckets, tokens, rows, offset = [], [], [], 0
        for bucket in torch.unique(bucket_of).tolist():
            chosen = (bucket_of == bucket).nonzero().squeeze(1)
            bucket_len = int(lengths[chosen].max())
            offsets = torch.arange(bucket_len)
            real = offsets < lengths[chosen].view(-1, 1)
            index = starts[chosen].view(-1, 1) + offsets
            index = torch.where(real, index, starts[chosen].view(-1, 1))  # pads repeat a real token
            buckets.append(to_device(index, device))
            tokens.append(index[real])
            rows.append(offset + real.reshape(-1).nonzero().squeeze(1))
            offset += index.numel()
        rows_in_token_order = torch.cat(rows)[torch.argsort(torch.cat(tokens))]
        return buckets, to_device(rows_in_token_order, device)

    def attend(self, q, k, v, dropout: float) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D], causal within each document.
        The varlen path traces under torch.compile (the kernel is a custom op); the buckets,
        planned from host values, run outside the compiled graph."""
        batch, length = self.shape
        heads, head_dim = q.shape[1], q.shape[-1]
        flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim) for t in (q, k, v)]
        half = flash_attention_dtype(q)
        if half is not None and dropout == 0.0 and _flash_varlen_available(q):
            out = causal_varlen_attn(*(t.to(half) for t in flat), self.cu_seqlens, self.max_length)
        else:
            out = self._attend_in_buckets(*flat, dropout)
        return out.view(batch, length, heads, head_dim).transpose(1, 2)

    @torch.compiler.disable
    def _attend_in_buckets(self, q, k, v, dropout: float) -> torch.Tensor:
        """Flat q [N, H, D], k/v [N, H_kv, D] -> [N, H, D] through SDPA, one bucket at a time."""
        buckets, rows = self.buckets
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        qkv = torch.cat([q, k, v], dim=1)  # one gather per bucket (and one scatter back) for q, k and v
        expand = gqa_needs_expanded_heads(q, k, masked=False)
        padded = []
        for index in buckets:
            qb, kb, vb = qkv[index].transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)  # [n, H, L, D]
            if expand:
                kb, vb = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kb, vb))
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, dropout_p=dropout,
                                                enable_gqa=kb.shape[1] != heads)
            padded.append(ob.transpose(1, 2).reshape(-1, heads, head_dim))
        return torch.cat(padded)[rows]  # every token's output, pads left out, in token order

    def dense(self) -> torch.Tensor:
        """The equivalent boolean [B, 1, T, T] mask (True = attend), for eager attention."""
        batch, length = self.shape
        ids = torch.zeros(batch * length, dtype=torch.long)
        ids[self.starts] = 1
        ids = to_device(ids.cumsum(0).view(batch, length), self.device)  # document number of every token
        same = ids.view(batch, 1, length, 1) == ids.view(batch, 1, 1, length)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        return same & causal


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's copy on `device` that the host does not wait for: to a GPU from page-locked
    memory (from pageable memory the driver may wait for the stream before it copies)."""
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def causal_varlen_attn(q, k, v, cu_seqlens: torch.Tensor, max_length: int) -> torch.Tensor:
    """varlen_attn, causal within each document, on flat q [N, H, D] and k/v [N, H_kv, D], in the
    keywords this torch's varlen_attn takes: causality as `window_size=(-1, 0)` (or the older
    `is_causal=True`); without `enable_gqa` the k/v heads are repeated up to q's."""
    options = {"window_size": (-1, 0)} if _varlen_takes("window_size") else {"is_causal": True}
    if _varlen_takes("enable_gqa"):
        options["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
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
