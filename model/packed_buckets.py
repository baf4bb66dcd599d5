"""The bucketed path of packed attention: documents of similar length (the same power-of-two
bucket) gathered into small right-padded [n, L] batches and run through causal SDPA, one bucket at
a time (model/packed_attention.py says when this path runs).

The padding sits after every real token, so causal attention never lets a real token see it; a
bucket pads a document to at most twice its length. The plan of the buckets is made on the CPU
(`plan_buckets`, by the collator) and read on the host only there and here, never from a GPU.

Under torch.compile (no dropout) the buckets run as one custom op, `minisft::bucketed_attention`,
whose inputs are a fixed set of tensors whatever the number and lengths of the buckets, so the
compiled graph has no break there and is not compiled again per layout. On the CPU it calls the
kernel that SDPA chooses there for every dtype and head size (its flash kernel), keeps the
kernel's logsumexp and hands both to that kernel's backward: the same kernels as eager autograd,
the same output and gradients bit for bit. On other devices (a GPU in float32, or one without
FlashAttention) its backward computes the buckets' forward again and differentiates it, the same
ops as eager autograd at the cost of one more attention forward per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Power-of-two buckets (0, 1], (1, 2], (2, 4], ...: one row of `bucket_shapes` each, as many as an
# int64 length can need, so that the plan's shapes tensor has one size for every layout (an input
# of the compiled `bucketed_attention` that never changes shape).
BUCKETS = 64


def plan_buckets(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SDPA buckets of documents (CPU `document_starts`): (`gather`: the flat token index of
    every bucket's [n, L] batch, bucket after bucket, a pad repeating its document's first token;
    `bucket_shapes` [BUCKETS, 2]: each bucket's (n, L), (0, 0) where no document falls; `rows`:
    the rows of the buckets' padded outputs, flattened one after the other, that hold each token's
    output, in token order). Padding at most doubles a document."""
    bucket_of = torch.ceil(torch.log2(lengths.double())).long()
    bucket_shapes = [(0, 0)] * BUCKETS
    gather, tokens, rows, offset = [], [], [], 0
    for bucket in torch.unique(bucket_of).tolist():
        chosen = (bucket_of == bucket).nonzero().squeeze(1)
        doc_starts, doc_lengths = starts[chosen].view(-1, 1), lengths[chosen].view(-1, 1)
        offsets = torch.arange(int(doc_lengths.max()))
        real = offsets < doc_lengths
        index = torch.where(real, doc_starts + offsets, doc_starts)  # pads repeat a real token
        bucket_shapes[bucket] = tuple(index.shape)
        gather.append(index.reshape(-1))
        tokens.append(index[real])
        rows.append(offset + real.reshape(-1).nonzero().squeeze(1))
        offset += index.numel()
    rows_in_bucket_order = torch.cat(rows)
    rows_in_token_order = torch.empty_like(rows_in_bucket_order)
    rows_in_token_order[torch.cat(tokens)] = rows_in_bucket_order
    return torch.cat(gather), torch.tensor(bucket_shapes), rows_in_token_order


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's copy on `device` that the host does not wait for: to a GPU from page-locked
    memory (from pageable memory the driver may wait for the stream before it copies)."""
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _shapes(bucket_shapes: torch.Tensor) -> list[tuple[int, int]]:
    return [(n, length) for n, length in bucket_shapes.tolist() if n]


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """`flat`'s first dimension cut into the buckets' n x L rows (one bucket: the whole tensor; a
    split of one piece would concatenate it again in the backward)."""
    return list(flat.split([n * length for n, length in shapes])) if len(shapes) > 1 else [flat]


def _by_heads(chunk: torch.Tensor, n: int, length: int, counts: list[int]) -> list[torch.Tensor]:
    """A bucket's [n x L, heads, D] rows as [n, heads, L, D] tensors of `counts` heads each (split
    before the transposes: their gradients then concatenate into chunk's layout)."""
    return [t.transpose(1, 2) for t in chunk.view(n, length, -1, chunk.shape[-1]).split(counts, dim=2)]


def attend_in_buckets(q, k, v, gather: torch.Tensor, bucket_shapes: torch.Tensor, rows: torch.Tensor,
                      expand_heads: bool, dropout: float = 0.0) -> torch.Tensor:
    """Flat q [N, H, D], k/v [N, H_kv, D] -> [N, H, D] through SDPA, one bucket at a time, by the
    CPU plan of `plan_buckets` (its indices copied to q's device here). `expand_heads`: the k/v
    heads repeated for SDPA (`gqa_needs_expanded_heads`)."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    gather, rows = (to_device(t, q.device) for t in (gather, rows))
    shapes = _shapes(bucket_shapes)
    # One gather for all the buckets and one scatter back, for q, k and v: its gradient is one
    # scatter into one zero tensor (a gather per bucket would fill and add a full-size one each).
    gathered = torch.cat([q, k, v], dim=1)[gather]
    padded = []
    for chunk, (n, length) in zip(_split(gathered, shapes), shapes):
        qb, kb, vb = _by_heads(chunk, n, length, [heads, kv_heads, kv_heads])
        if expand_heads:
            kb, vb = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kb, vb))
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, dropout_p=dropout,
                                            enable_gqa=kb.shape[1] != heads)
        padded.append(ob.transpose(1, 2).reshape(-1, heads, head_dim))
    return torch.cat(padded)[rows]  # every token's output, pads left out, in token order


# Under torch.compile with dropout: outside the graph (the op's backward on a GPU computes the
# forward again, which would draw other dropout masks than the forward's).
attend_in_buckets_eagerly = torch.compiler.disable(attend_in_buckets)


def _keeps_logsumexp(q: torch.Tensor, expand_heads: bool) -> bool:
    """Whether `bucketed_attention` calls the attention kernel itself and keeps its logsumexp for
    the backward: on the CPU, where SDPA runs its flash kernel for every dtype and head size, and
    takes GQA's k/v heads as they are (`expand_heads` is for GPU kernels)."""
    return q.device.type == "cpu" and not expand_heads


def _logsumexp_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("minisft::bucketed_attention", mutates_args=())
def bucketed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gather: torch.Tensor,
                       bucket_shapes: torch.Tensor, rows: torch.Tensor,
                       expand_heads: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_in_buckets` without dropout as one op: (the output [N, H, D], the buckets'
    logsumexp [padded rows, H] where `_keeps_logsumexp`, else an empty tensor)."""
    if not _keeps_logsumexp(q, expand_heads):
        return attend_in_buckets(q, k, v, gather, bucket_shapes, rows, expand_heads), q.new_empty(0)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    shapes = _shapes(bucket_shapes)
    padded, logsumexps = [], []
    for chunk, (n, length) in zip(_split(torch.cat([q, k, v], dim=1)[gather], shapes), shapes):
        ob, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_by_heads(chunk, n, length, [heads, kv_heads, kv_heads]), 0.0, True)
        padded.append(ob.transpose(1, 2).reshape(-1, heads, head_dim))
        logsumexps.append(lse.transpose(1, 2).reshape(-1, heads))  # [n, H, L] -> its rows [n x L, H]
    return torch.cat(padded)[rows], torch.cat(logsumexps)


@bucketed_attention.register_fake
def _bucketed_attention_shapes(q, k, v, gather, bucket_shapes, rows, expand_heads):
    if not _keeps_logsumexp(q, expand_heads):
        return q.new_empty(q.shape), q.new_empty(0)
    return q.new_empty(q.shape), q.new_empty((gather.shape[0], q.shape[1]), dtype=_logsumexp_dtype(q))


@torch.library.custom_op("minisft::bucketed_attention_backward", mutates_args=())
def bucketed_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, logsumexp: torch.Tensor, gather: torch.Tensor,
                                bucket_shapes: torch.Tensor, rows: torch.Tensor,
                                expand_heads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `bucketed_attention` for q, k and v. With the logsumexp kept, the kernel's
    own backward per bucket on the forward's output and logsumexp laid out as the buckets were
    (pads hold zeros: a pad's output gradient is zero, so its output is never read); without it,
    the forward computed again and differentiated (`torch.func.vjp`: an op's body runs with
    autograd off). Either way the ops of eager autograd, bit for bit."""
    if not _keeps_logsumexp(q, expand_heads):
        def forward(*qkv):
            return attend_in_buckets(*qkv, gather, bucket_shapes, rows, expand_heads)

        _, pullback = torch.func.vjp(forward, q, k, v)
        # vjp's three gradients are slices of one (the concatenation's); the op returns three tensors
        return tuple(g.contiguous() for g in pullback(grad))
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    shapes = _shapes(bucket_shapes)
    counts = [heads, kv_heads, kv_heads]
    qkv = torch.cat([q, k, v], dim=1)
    grad_padded, out_padded = (t.new_zeros(gather.shape[0], heads, head_dim).index_put_((rows,), t)
                               for t in (grad, out))
    pieces = zip(_split(qkv[gather], shapes), _split(grad_padded, shapes), _split(out_padded, shapes),
                 _split(logsumexp, shapes), shapes)
    gradients = []
    for chunk, grad_b, out_b, lse_b, (n, length) in pieces:
        grad_b, out_b = (t.view(n, length, heads, head_dim).transpose(1, 2) for t in (grad_b, out_b))
        lse_b = lse_b.view(n, length, heads).transpose(1, 2)
        by_heads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_b, *_by_heads(chunk, n, length, counts), out_b, lse_b, 0.0, True)
        gradients.append(torch.cat([g.transpose(1, 2) for g in by_heads], dim=2).reshape(n * length, -1, head_dim))
    # the gather's gradient: each token's rows summed (a pad's are zeros), as autograd's index backward
    summed = torch.zeros_like(qkv).index_put_((gather,), torch.cat(gradients), accumulate=True)
    return tuple(g.contiguous() for g in summed.split(counts, dim=1))


@bucketed_attention_backward.register_fake
def _bucketed_attention_backward_shapes(grad, q, k, v, out, logsumexp, gather, bucket_shapes, rows, expand_heads):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs, output):
    q, k, v, gather, bucket_shapes, rows, ctx.expand_heads = inputs
    ctx.save_for_backward(q, k, v, *output, gather, bucket_shapes, rows)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _):
    grads = bucketed_attention_backward(grad, *ctx.saved_tensors, ctx.expand_heads)
    return (*grads, None, None, None, None)


bucketed_attention.register_autograd(_backward, setup_context=_save_for_backward)
