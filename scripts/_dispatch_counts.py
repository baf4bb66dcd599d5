"""Device-independent figures of the trainer's optimizer step: aten ops dispatched, dtype casts,
FLOPs, host reads of device values, and torch.compile's graph breaks and recompiles
(scripts/step_figures.py prints them).

A CPU run counts what a GPU would launch as kernels, as far as the model's own code decides it:
every op that reaches the dispatcher below autograd is one `TorchDispatchMode` call. "ops" are
the aten ops that compute (views, which launch nothing, are left out: `dispatches` counts them
too), and every `aten._to_copy` is a cast (the trainer's batches are already on the CPU, so no
copy moves between devices). The optimizer is fused AdamW as the
trainer builds it on CUDA, so that its per-parameter loops do not hide the model's figures.

Under torch.compile the counters stay off while dynamo traces and compiles and count what the
compiled code dispatches when it runs (`ignore_compile_internals`): a dispatch mode that does not
ignore compilation makes dynamo run every frame eagerly, so a counted step would compile nothing.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from scripts._bench_common import endless_batches, optimizer_step_once, single_process_context
from scripts._host_reads import HostReads
from trainer.args import parse_args
from trainer.data_setup import build_train_data
from trainer.loop.state import Run
from trainer.model_setup import build_model, build_model_config, build_optimizer, compile_model
from trainer.parallel.ddp import Replicated
from trainer.runtime.precision import build_grad_scaler
from trainer.runtime.preemption import PreemptionFlag
from trainer.runtime.seeding import setup_seed

CAST = torch.ops.aten._to_copy.default
VIEW_LIKE = {torch.ops.aten._unsafe_view.default}  # a view that autograd does not track as one


def computes(op) -> bool:
    """Whether a dispatched op is an aten op that can launch a kernel (not a view)."""
    return op.namespace == "aten" and not op.is_view and op not in VIEW_LIKE


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `aten._grouped_mm` (FlopCounterMode has no formula for it): 2 per multiply-add.
    2D x 2D (the groups split the contracted dimension): 2 * M * S * N; otherwise every output
    element contracts a's last dimension."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def custom_op_bodies() -> dict:
    """The project's custom ops whose bodies run GEMMs -> those bodies. A dispatch mode sees a custom
    op as one call and not the ops its body runs, so a FLOP counter runs the body itself: the chunked
    LM loss (the LM head's GEMMs, eager and compiled), the experts' grouped GEMM where its operands are
    copied and under torch.compile, and the joined GEMMs' gradients under torch.compile. The bucketed
    attention is left out: torch's counter has no formula for the CPU's attention kernel."""
    from model import compute_weights, feed_forward, loss

    ops = torch.ops.minisft
    return {ops.lm_loss_forward.default: loss.lm_loss_chunks,
            ops.lm_loss_backward.default: loss.lm_loss_gradient_chunks,
            ops.grouped_mm.default: feed_forward.grouped_mm_of_copies,
            ops.experts_gradients.default: feed_forward.experts_gradients,
            ops.joined_linear_gradients.default: compute_weights.linear_gradients}


class _CompiledFlopMode(_FlopCounterMode):
    """FlopCounterMode's dispatch mode, counting the ops compiled code runs (module docstring) and
    the ops of the bodies of `custom_op_bodies`."""

    def __init__(self, counter: FlopCounterMode):
        super().__init__(counter)
        self.bodies = custom_op_bodies()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self.bodies.get(func)
        if body is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        with self:
            return body(*args, **(kwargs or {}))


class StepFlopCounter(FlopCounterMode):
    """FlopCounterMode whose mode lets torch.compile compile (module docstring); all FLOPs are
    counted as "Global" (no per-module table: its module hooks would be traced by dynamo)."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _CompiledFlopMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        done, self.mode = self.mode.__exit__(*args), None
        return done


def flop_counter() -> FlopCounterMode:
    """A FLOP counter that also counts grouped GEMMs (the MoE experts) and the GEMMs inside the
    project's custom ops (`custom_op_bodies`)."""
    return StepFlopCounter(display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flops})


class DispatchCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by op (`ops`), and the casts among them; inside
    compiled code, the ops it runs (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def dispatches(self) -> int:
        return sum(self.ops.values())

    @property
    def total(self) -> int:
        return sum(count for op, count in self.ops.items() if computes(op))

    @property
    def casts(self) -> int:
        return self.ops[CAST]


@dataclass
class StepFigures:
    """Per counted optimizer step: ops, casts and FLOPs; over the whole run: compile figures."""

    ops: list[int] = field(default_factory=list)
    dispatches: list[int] = field(default_factory=list)
    casts: list[int] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    expert_flops: list[int] = field(default_factory=list)  # the MoE experts' grouped GEMMs (0: a dense model)
    experts: int | None = None  # the MoE's experts per layer and experts per token (None: a dense model)
    experts_per_token: int | None = None
    host_reads: list[list[str]] | None = None  # per step, each read of a device value: "item at file:line in f"
    graph_breaks: int | None = None  # over all steps, each reason counted once per compiled frame
    recompiles: int | None = None  # frames compiled after the first step (new shapes, failed guards)
    frames: int | None = None  # frames compiled in all


def build_step_run(trainer_argv: list[str], backend: str = "inductor") -> Run:
    """The trainer's Run for these trainer flags, in one CPU process, with fused AdamW (its CUDA choice);
    with --use_compile 1 its blocks compiled with torch.compile's `backend`."""
    args = parse_args(trainer_argv + ["--device", "cpu"])
    ctx = single_process_context(torch.device("cpu"))
    from dataset import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer_path)
    with contextlib.redirect_stdout(io.StringIO()):
        data = build_train_data(args, tokenizer, ctx)
    setup_seed(args.seed)
    model = build_model(args, build_model_config(args, tokenizer), ctx.device)
    parallel = Replicated(ctx)
    parallel.wrap(model)
    optimizer = build_optimizer(model, args, torch.device("cuda"))  # fused=True, as on a GPU
    wrapped = compile_model(model, ctx.device, backend) if args.use_compile else model
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    run = Run(args, ctx, wrapped, optimizer, build_grad_scaler(ctx.device, dtype), dtype, data, eval_sets=[],
              tokenizer=tokenizer, logger=None, preemption=PreemptionFlag(), parallel=parallel)
    run.model.train()
    return run


def measure(trainer_argv: list[str], warmup_steps: int, steps: int, backend: str = "inductor") -> StepFigures:
    """`warmup_steps` (at least 1) uncounted optimizer steps, then `steps` counted ones (ops, casts, FLOPs,
    the MoE experts' FLOPs and, without --use_compile, the host reads of device values each: see
    scripts/_host_reads.py). With --use_compile 1 the dispatch counts are those of the compiled graphs'
    own calls (with the eager backend: the traced ops), and the compile figures cover every step."""
    from torch._dynamo.utils import counters

    counters.clear()
    run = build_step_run(trainer_argv, backend)
    batches = endless_batches(run.data)
    optimizer_step_once(run, batches, run.args)  # the first step compiles
    compiled_by_first = counters["frames"]["ok"]
    for _ in range(warmup_steps - 1):
        optimizer_step_once(run, batches, run.args)
    config = run.raw_model.config
    figures = StepFigures(host_reads=None if run.args.use_compile else [])
    if config.use_moe:
        figures.experts, figures.experts_per_token = config.num_experts, config.num_experts_per_tok
    for _ in range(steps):
        counter, flops = DispatchCounter(), flop_counter()
        # eager only: a dispatch mode does not see the tensors compiled code computes, so it could not mark them
        reads = None if run.args.use_compile else HostReads(run.model, run.optimizer)
        with flops, counter:
            optimizer_step_once(run, batches, run.args, reads)
        figures.ops.append(counter.total)
        figures.dispatches.append(counter.dispatches)
        figures.casts.append(counter.casts)
        figures.flops.append(flops.get_total_flops())
        figures.expert_flops.append(flops.get_flop_counts()["Global"].get(torch.ops.aten._grouped_mm, 0))
        if reads is not None:
            figures.host_reads.append(reads.reads)
    if run.args.use_compile:
        figures.graph_breaks = sum(counters["graph_break"].values())
        figures.frames = counters["frames"]["ok"]
        figures.recompiles = figures.frames - compiled_by_first
    return figures


def span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"
