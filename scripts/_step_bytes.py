"""Bytes the trainer's optimizer step moves through GPU memory, by aten op, and a roofline estimate
of its GPU time (scripts/step_figures.py --bytes prints them).

Every op dispatched in the forward, the backward, the gradient clipping and the fused AdamW step
is counted with the bytes of its tensor inputs (read) and of its outputs and mutated inputs
(written); views move nothing and are left out, an allocation (`empty`) writes nothing, and a
tensor broadcast from fewer elements (an `expand`) is read at the size of its storage, a gather
reads the elements it picks, a scatter touches as many as its source holds. FLOPs are
torch.utils.flop_counter's formulas (GEMMs), grouped GEMMs as in _dispatch_counts.py, and for
FlashAttention (varlen and SDPA's) 4 FLOPs per computed (query, key) pair, head and head dimension
forward and 10 backward (its backward recomputes the scores: five GEMMs); a causal kernel
computes the pairs of the lower triangle, per document of a packed row. The
roofline of one op is max(bytes / memory bandwidth, FLOPs / tensor-core peak), summed over the
ops: a lower bound on the GPU time of the step, which a kernel reaches only at full bandwidth or
full tensor-core use. The bandwidth and peak are a card's datasheet figures (trainer/runtime/datasheets.py):
the H100 SXM's (`ESTIMATE_CARD`), or on a GPU the profiled card's (scripts/profile_step.py).

The step is traced with fake tensors (no memory, no arithmetic), so a GPU-sized batch costs
seconds. The fake device is the CPU with the CUDA kernel choices of the model made as a GPU
makes them (`cuda_kernel_choices`): a CPU-only torch aborts the process when autograd records a
fake `cuda` tensor (no CUDA device guard is linked: `torch::autograd::InputMetadata` asks for
one), so the backward of a fake-cuda step cannot be traced on such a build. On a fake CPU the
model would choose its CPU kernels: the RMSNorm's hand-written backward instead of ATen's fused
CUDA kernel (`_fused_rms_norm`, which a CPU build does not have, so it is stood in for by ops of
the same inputs and outputs) and SDPA over document buckets instead of FlashAttention's varlen
kernel; and fake tensors are no type the foreach kernels take, so gradient clipping would loop
over the parameters. Autocast is the CPU's; the model casts its GEMM inputs itself and runs its
norms with autocast off, so no op changes dtype between the two (tests/scripts/test_step_bytes.py
compares the forward with one traced on a fake cuda device).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

import model.packed_attention as packed_attention
import model.rms_norm as rms_norm_module
from model.loss import lm_loss_chunks, lm_loss_gradient_chunks
from trainer.runtime.datasheets import Datasheet, datasheet_for
from scripts._dispatch_counts import VIEW_LIKE, grouped_mm_flops
from scripts._host_reads import written_arguments

ESTIMATE_CARD = datasheet_for("H100")  # the H100 SXM: HBM3, dense bf16, IEEE fp32 (--dtype float32: no TF32)
ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
               torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
               torch.ops.aten.new_empty_strided.default}  # write nothing
OVERWRITES = {torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}
FUSED_ADAM = {torch.ops.aten._fused_adamw_.default, torch.ops.aten._fused_adam_.default}
# SDPA's FlashAttention kernels, CUDA's and the CPU's (the default path, rows without packing):
# FLOPs counted as for the varlen kernel, causal blocks skipped.
SDPA_FLASH = {torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
# Ops that read of their first input only the elements they pick (at most the output's size) ...
GATHERS = {torch.ops.aten.gather.default, torch.ops.aten.index_select.default, torch.ops.aten.index.Tensor,
           torch.ops.aten.embedding.default}
# ... and in-place ops that touch of their first input only as many elements as their index or source has.
SCATTERS = {torch.ops.aten.scatter_add_.default, torch.ops.aten.scatter_.src, torch.ops.aten.scatter_.value,
            torch.ops.aten.index_add_.default, torch.ops.aten.index_put_.default, torch.ops.aten.index_copy_.default,
            torch.ops.aten.index_fill_.int_Scalar}


# --------------------------------------------------------------------------- the fused RMSNorm


@torch.library.custom_op("minisft_trace::_fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's CUDA `_fused_rms_norm` as one op: (y in x's dtype, float32 1/rms per row)."""
    inverse = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * inverse * weight.float()).to(x.dtype), inverse


@fused_rms_norm.register_fake
def _fused_rms_norm_shapes(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("minisft_trace::_fused_rms_norm_backward", mutates_args=())
def fused_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's CUDA `_fused_rms_norm_backward` as one op: (grad of x, grad of weight)."""
    normed = x.float() * inverse
    grad_weight = (grad.float() * normed).reshape(-1, x.shape[-1]).sum(0)
    grad_normed = grad.float() * weight.float()
    grad_x = (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)) * inverse
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


@fused_rms_norm_backward.register_fake
def _fused_rms_norm_backward_shapes(grad, x, weight, inverse):
    return torch.empty_like(x), torch.empty_like(weight)


def _save_norm_inputs(ctx, inputs, output):
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _norm_backward(ctx, grad, _grad_inverse):
    x, weight, inverse = ctx.saved_tensors
    grad_x, grad_weight = fused_rms_norm_backward(grad, x, weight, inverse)
    return grad_x, grad_weight, None


fused_rms_norm.register_autograd(_norm_backward, setup_context=_save_norm_inputs)


class _FusedRMSNormAsOnCuda:
    """Stands in for model/rms_norm.py's CPU function where a CUDA tensor calls `F.rms_norm`."""

    @staticmethod
    def apply(x, weight, eps):
        return fused_rms_norm(x, weight, eps)[0]


# --------------------------------------------------------------------------- the CUDA kernel choices


def _half_precision_as_on_cuda(q: torch.Tensor):
    if q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    dtype = torch.get_autocast_dtype(q.device.type)
    return dtype if torch.is_autocast_enabled(q.device.type) and dtype in (torch.float16, torch.bfloat16) else None


def _flash_runs_as_on_sm80(device_index, dtype, head_dim: int, backward: bool) -> bool:
    return head_dim <= 256


@contextlib.contextmanager
def cuda_kernel_choices(counter: ByteCounter):
    """The step's kernel choices as on an sm80+ GPU while inside: the RMSNorm as one fused op,
    packed rows through the varlen FlashAttention op (its causal pairs told to `counter`),
    gradient clipping with the foreach kernels."""
    real_attend = packed_attention.PackedDocuments.attend

    def attend(documents, q, k, v, dropout):
        counter.attention_pairs = counter.layout_pairs[id(documents)]
        return real_attend(documents, q, k, v, dropout)

    clip_with_foreach_kernels = functools.partial(torch.nn.utils.clip_grad_norm_, foreach=True)
    patches = [(rms_norm_module, "_RMSNormFunction", _FusedRMSNormAsOnCuda),
               (torch.nn.utils, "clip_grad_norm_", clip_with_foreach_kernels),
               (packed_attention, "_half_precision_dtype", _half_precision_as_on_cuda),
               (packed_attention, "_flash_runs", _flash_runs_as_on_sm80),
               (packed_attention.PackedDocuments, "attend", attend)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


# --------------------------------------------------------------------------- the counter


# Traced ops whose GPU kernels a profile charges to another traced op (torch.profiler gives a
# kernel's time to the innermost op that launched it): a cast's copy to copy_, the LM loss body's
# matmul to mm.
_PROFILE_OWNER = {"_to_copy": "copy_", "to": "copy_", "matmul": "mm"}


def profile_key(name: str) -> str:
    """A traced op's name ("sub.Tensor", "minisft_trace::_fused_rms_norm") or a GPU profile's op key
    ("aten::sub") as scripts/profile_step.py joins them: without namespace and overload, a cast and
    the loss's matmul under the op that runs their kernels."""
    base = name.split("::")[-1].split(".")[0]
    return _PROFILE_OWNER.get(base, base)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads of `t` (or writes): its elements, or its storage when broadcast from fewer."""
    size = t.numel() * t.element_size()
    try:
        return min(size, t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return size


def _tensors(tree) -> list[torch.Tensor]:
    seen, found = set(), []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            found.append(leaf)
    return found


def moves_memory(op) -> bool:
    """An op that runs a kernel over tensors: not a view, no profiler or device query."""
    return op.namespace not in ("prim", "profiler") and not op.is_view and op not in VIEW_LIKE


def logsumexp_passes(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """aten.logsumexp as ATen computes it, in its separate kernels: the maximum, set to 0 where
    infinite, subtracted before exp, the sum, its log plus the maximum. Below autograd (inside a
    custom op) logsumexp reaches the counter as one op, which would count one pass of the four."""
    maxes = torch.amax(x, dim, keepdim=True)
    maxes = maxes.masked_fill(maxes.abs() == float("inf"), 0)
    total = (x - maxes).exp_().sum(dim, keepdim=keepdim)
    return total.log_().add_(maxes if keepdim else maxes.squeeze(dim))


def converts(op, args, out) -> bool:
    """`aten.to` that made a new tensor (another dtype): a view by its schema, a cast when it runs,
    as `Tensor.float()` inside the LM loss's custom ops, which are counted below autograd."""
    return op.overloadpacket is torch.ops.aten.to and out is not args[0]


def _factory(op) -> bool:
    """`new_zeros`, `full_like` and the like: their tensor input gives a shape and a dtype, no values."""
    name = op._opname
    return name.startswith("new_") or name.endswith("_like")


@dataclass
class OpTraffic:
    """One op name's total over a step: calls, bytes read and written, FLOPs, roofline seconds."""

    calls: int = 0
    read: int = 0
    written: int = 0
    flops: int = 0
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return self.read + self.written

    def add(self, other: OpTraffic) -> OpTraffic:
        for key in ("calls", "read", "written", "flops", "seconds"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        return self


class ByteCounter(TorchDispatchMode):
    """Bytes read and written, FLOPs and the roofline time of every op dispatched inside, by op name
    (`groups`), or with `by_shapes` by op name and the shapes and dtypes of its tensor inputs. The
    chunked LM loss's custom ops are counted as the ops their bodies run."""

    def __init__(self, bandwidth: float = ESTIMATE_CARD.bandwidth, peak: float = ESTIMATE_CARD.peak("bfloat16"),
                 by_shapes: bool = False):
        super().__init__()
        self.bandwidth, self.peak, self.by_shapes = bandwidth, peak, by_shapes
        self.groups: dict[str, OpTraffic] = collections.defaultdict(OpTraffic)
        self.attention_pairs = 0  # causal pairs of the varlen attention calls (`cuda_kernel_choices`)
        self.layout_pairs: dict[int, int] = {}  # id of a micro-batch's PackedDocuments -> its causal pairs
        self.expanded = {torch.ops.minisft.lm_loss_forward.default: lm_loss_chunks,
                         torch.ops.minisft.lm_loss_backward.default: lm_loss_gradient_chunks,
                         torch.ops.aten.logsumexp.default: logsumexp_passes}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = self.expanded.get(func)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        if moves_memory(func) or converts(func, args, out):
            self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs, out) -> None:
        given = {arg.name: value for arg, value in zip(func._schema.arguments, args)} | kwargs
        schema = {arg.name: arg for arg in func._schema.arguments}
        mutated = _tensors(written_arguments(func, args, kwargs))
        if func in FUSED_ADAM and given.get("grad_scale") is None:  # grads are written only to unscale them
            mutated = [t for t in mutated if all(t is not g for g in given["grads"])]
        unread = _tensors([value for name, value in given.items() if schema[name].is_out])
        if func in OVERWRITES:
            unread += mutated
        inputs = [] if _factory(func) else [t for t in _tensors((args, kwargs)) if all(t is not u for u in unread)]
        outputs = _tensors(out)
        written = outputs + [t for t in mutated if all(t is not o for o in outputs)]
        name = func.name().removeprefix("aten::").removeprefix("minisft_trace::")
        if self.by_shapes:
            name += " " + " ".join(f"{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in inputs)
        traffic = self.groups[name]
        traffic.calls += 1
        sizes = {id(t): tensor_bytes(t) for t in inputs + written}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in GATHERS:
            sizes[id(first)] = min(sizes[id(first)], sum(map(tensor_bytes, outputs)))
        elif func in SCATTERS:
            touched = max(t.numel() for t in _tensors((args[1:], kwargs)))
            sizes[id(first)] = min(sizes[id(first)], touched * first.element_size())
        read = sum(sizes[id(t)] for t in inputs)
        write = 0 if func in ALLOCATIONS else sum(sizes[id(t)] for t in written)
        flops = self.flops(func, args, kwargs, out)
        traffic.read += read
        traffic.written += write
        traffic.flops += flops
        traffic.seconds += max((read + write) / self.bandwidth, flops / self.peak)

    def flops(self, func, args, kwargs, out) -> int:
        if func is torch.ops.aten._grouped_mm.default:
            return grouped_mm_flops(args[0].shape, args[1].shape, out_shape=out.shape)
        per_pair = 10 if "backward" in func.name() else 4
        if func.namespace == "torch_attn":  # varlen FlashAttention: q [N, H, D]
            heads, head_dim = args[0].shape[1], args[0].shape[2]
            return per_pair * self.attention_pairs * heads * head_dim
        if func in SDPA_FLASH:  # q [B, H, T, D], k [B, H_kv, S, D], then dropout_p and is_causal
            given = {arg.name: value for arg, value in zip(func._schema.arguments, args)} | kwargs
            (batch, heads, length, head_dim), keys = given["query"].shape, given["key"].shape[2]
            pairs = length * (length + 1) // 2 if given["is_causal"] else length * keys
            return per_pair * batch * pairs * heads * head_dim
        if func is torch.ops.aten.matmul.default:  # the LM loss's body, below autograd: not decomposed
            return 2 * out.numel() * args[0].shape[-1]
        formula = flop_registry.get(func._overloadpacket)
        return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0

    @property
    def total(self) -> OpTraffic:
        total = OpTraffic()
        for traffic in self.groups.values():
            total.add(traffic)
        return total


# --------------------------------------------------------------------------- the trainer's step


def fake_parameters(model: torch.nn.Module, mode: FakeTensorMode, device: str = "cpu") -> None:
    """Every parameter and buffer of `model` replaced by a fake tensor of its shape on `device`
    (tied parameters stay tied)."""
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in fakes:
                    fakes[id(param)] = torch.nn.Parameter(fake(param), param.requires_grad)
                module._parameters[name] = fakes[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = fake(buffer)


def measure_bytes(trainer_argv: list[str], warmup_steps: int = 1, by_shapes: bool = False,
                  steps: int = 1, card: Datasheet = ESTIMATE_CARD) -> ByteCounter:
    """`steps` optimizer steps of the trainer for these flags (summed), traced as described in the
    module docstring, after `warmup_steps` uncounted ones (the first creates AdamW's moments); the
    roofline of `card`."""
    from scripts._bench_common import endless_batches
    from model.flops import causal_pairs
    from scripts._dispatch_counts import build_step_run
    from trainer.loop.loop import agree_on_step, optimizer_step
    from trainer.model_setup import build_optimizer

    run = build_step_run(trainer_argv + ["--use_compile", "0"])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_parameters(run.parallel.model, mode)
    run.optimizer = build_optimizer(run.parallel.model, run.args, torch.device("cuda"))  # fused, as on a GPU
    batches = endless_batches(run.data)
    peak = card.peak("float32" if run.dtype == torch.float32 else "bfloat16")
    counter = ByteCounter(bandwidth=card.bandwidth, peak=peak, by_shapes=by_shapes)
    for step in range(warmup_steps + steps):
        micro_batches = [next(batches) for _ in range(run.args.accumulation_steps)]
        totals = agree_on_step(run, micro_batches)  # host values of the real batches
        counter.layout_pairs = {id(batch["packed_layout"]): causal_pairs(batch)
                                for batch in micro_batches if "packed_layout" in batch}
        counting = counter if step >= warmup_steps else contextlib.nullcontext()
        with mode, cuda_kernel_choices(counter), counting:
            optimizer_step(run, micro_batches, totals, run.args.learning_rate)
    return counter


def roofline_table(counter: ByteCounter, top: int = 15) -> list[str]:
    """Lines: the `top` op names by roofline time, then the whole step."""
    rows = sorted(counter.groups.items(), key=lambda item: -item[1].seconds)
    lines = [f"{'calls':>6} {'GB read':>9} {'GB written':>10} {'GFLOP':>9} {'est ms':>8}  op"]

    def line(name: str, t: OpTraffic) -> str:
        return (f"{t.calls:>6} {t.read / 1e9:>9.2f} {t.written / 1e9:>10.2f} {t.flops / 1e9:>9.0f} "
                f"{t.seconds * 1e3:>8.2f}  {name}")

    lines += [line(name, traffic) for name, traffic in rows[:top]]
    if len(rows) > top:
        rest = OpTraffic()
        for _, traffic in rows[top:]:
            rest.add(traffic)
        lines.append(line(f"({len(rows) - top} other ops)", rest))
    lines.append(line("step", counter.total))
    return lines

