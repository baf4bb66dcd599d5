"""Per optimizer step of the trainer: aten ops dispatched, dtype casts, FLOPs (with --use_moe 1 the
experts' own), host reads of device values (eager); with --use_compile 1 also graph breaks and
recompiles. Device-independent figures, measured on the CPU.

    python scripts/step_figures.py                         # the default layout, batch 4, bf16, length-grouped
    python scripts/step_figures.py --packing 1
    python scripts/step_figures.py --use_moe 1
    python scripts/step_figures.py --use_compile 1 --steps 12 --compile_backend eager
    python scripts/step_figures.py --bytes --packing 1 --max_seq_len 2048 --batch_size 32 --measured_ms 172

Every flag this script does not know is the trainer's own (train_full_sft.py --help); the
defaults differ only in --batch_size 4 and --dtype bfloat16 (CPU autocast). The step is
trainer/loop/loop.optimizer_step with the trainer's model, loader and fused AdamW (the CUDA
choice); what is counted is described in scripts/_dispatch_counts.py. With --bytes: the bytes each
op reads and writes in GPU memory and a roofline estimate of the step's GPU time, traced with fake
tensors (scripts/_step_bytes.py; seconds for any batch). docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import ArgumentParser, run_main  # noqa: E402
from scripts._dispatch_counts import measure, span  # noqa: E402
from scripts._step_bytes import measure_bytes, roofline_table  # noqa: E402
from trainer.args import add_flag, parse_args  # noqa: E402

DEFAULT_TRAINER_FLAGS = {"--batch_size": "4", "--dtype": "bfloat16"}


def build_parser() -> ArgumentParser:
    defaults = " and ".join(f"{flag} {value}" for flag, value in DEFAULT_TRAINER_FLAGS.items())
    parser = ArgumentParser(prog="step_figures.py", description=__doc__.split("\n\n")[0],
                            epilog=f"Every other flag is the trainer's (python train_full_sft.py --help), with {defaults} "
                                   "unless given.")
    add_flag(parser, "--warmup_steps", type=int, default=1, at_least=1, help="uncounted optimizer steps first (at least 1)")
    add_flag(parser, "--steps", type=int, default=3, at_least=1, help="counted optimizer steps")
    parser.add_argument("--compile_backend", default=None,
                        help="with --use_compile 1: torch.compile's backend (default: inductor; eager: the same "
                             "graphs, compiled fast)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--bytes", action="store_true",
                        help="instead: bytes each op reads and writes per optimizer step and a roofline estimate of "
                             "its time on an H100 (fake tensors, the CUDA kernel choices)")
    add_flag(parser, "--top", type=int, default=None, at_least=1,
             help="with --bytes: the ops shown one by one (default 15)")
    parser.add_argument("--by_shapes", action="store_true",
                        help="with --bytes: one row per op and shapes and dtypes of its tensor inputs")
    add_flag(parser, "--measured_ms", type=float, default=None, above=0,
             help="with --bytes: a step time measured on an H100 at these flags, printed against the estimate")
    return parser


def compile_backends() -> list[str]:
    """The names torch.compile takes as `backend`, those tagged for debugging (eager) among them."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def with_trainer_defaults(unknown: list[str]) -> list[str]:
    given = {arg.split("=")[0] for arg in unknown if arg.startswith("--")}
    defaults = [part for flag, value in DEFAULT_TRAINER_FLAGS.items() if flag not in given for part in (flag, value)]
    return defaults + unknown


def main(argv=None) -> int:
    options, unknown = build_parser().parse_known_args(argv)  # the ranges: checked when parsed
    flags = with_trainer_defaults(unknown)
    bytes_only = [name for name in ("top", "by_shapes", "measured_ms") if getattr(options, name) not in (None, False)]
    if bytes_only and not options.bytes:
        build_parser().error(f"--{bytes_only[0]} needs --bytes")
    compiled = parse_args(flags).use_compile
    if options.bytes and compiled:
        build_parser().error("--bytes traces the eager step: leave out --use_compile")
    if options.compile_backend is not None and not compiled:
        build_parser().error("--compile_backend needs --use_compile 1")
    if options.compile_backend is not None and options.compile_backend not in compile_backends():
        build_parser().error(f"--compile_backend {options.compile_backend}: not a torch.compile backend (eager, "
                             "inductor, ...: torch._dynamo.list_backends(exclude_tags=()))")
    backend = options.compile_backend or "inductor"
    if options.bytes:
        return print_bytes(flags, options)
    figures = measure(flags, options.warmup_steps, options.steps, backend)
    if options.json:
        print(json.dumps({"flags": flags, **vars(figures)}))
        return 0
    print(f"trainer flags: {' '.join(flags)}")
    print(f"per optimizer step ({options.steps} counted after {options.warmup_steps} warm-up): "
          f"aten ops {span(figures.ops)} (with views {span(figures.dispatches)}), casts (_to_copy) "
          f"{span(figures.casts)}, "
          f"GFLOP {gflop(figures.flops)}")
    if figures.experts is not None:
        experts, top_k = figures.experts, figures.experts_per_token
        every = [flops * experts // top_k for flops in figures.expert_flops]
        print(f"MoE experts (grouped GEMMs, top-{top_k} of {experts} per token): GFLOP {gflop(figures.expert_flops)}, "
              f"{top_k}/{experts} of running every expert on every token ({gflop(every)})")
    if figures.host_reads is None:
        print("host reads of device values: counted without --use_compile (a dispatch mode does not see the tensors "
              "compiled code computes)")
    else:
        places = sorted({read for step in figures.host_reads for read in step})
        print(f"host reads of device values per step: {span([len(step) for step in figures.host_reads])}"
              + "".join(f"\n  {place}" for place in places))
    if figures.frames is not None:
        print(f"torch.compile ({backend}): graph breaks {figures.graph_breaks}, frames compiled "
              f"{figures.frames}, recompiles after the first step {figures.recompiles}")
    return 0


def gflop(flops: list[int]) -> str:
    return f"{min(flops) / 1e9:.2f}-{max(flops) / 1e9:.2f}"


def print_bytes(flags: list[str], options) -> int:
    counter = measure_bytes(flags, options.warmup_steps, options.by_shapes)
    total = counter.total
    if options.json:
        groups = {name: vars(traffic) for name, traffic in counter.groups.items()}
        print(json.dumps({"flags": flags, "groups": groups, "bytes": total.bytes, "flops": total.flops,
                          "peak_flops_per_s": counter.peak, "roofline_ms": total.seconds * 1e3}))
        return 0
    print(f"trainer flags: {' '.join(flags)}")
    print(f"one eager optimizer step after {options.warmup_steps} warm-up, fake tensors, the CUDA kernel choices; "
          f"roofline per op = max(bytes / {counter.bandwidth / 1e12:.2f} TB/s, FLOPs / "
          f"{counter.peak / 1e12:.1f} TFLOP/s), an estimate, not a GPU measurement")
    print("\n".join(roofline_table(counter, 15 if options.top is None else options.top)))
    if options.measured_ms:
        print(f"measured {options.measured_ms:.1f} ms per step: {options.measured_ms / (total.seconds * 1e3):.2f}x "
              f"the roofline estimate of {total.seconds * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    run_main(main)
