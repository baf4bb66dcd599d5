"""Per optimizer step of the trainer: aten ops dispatched, dtype casts, FLOPs; with --use_compile 1
also graph breaks and recompiles. Device-independent figures, measured on the CPU.

    python scripts/step_figures.py                         # the default layout, batch 4, bf16, length-grouped
    python scripts/step_figures.py --packing 1
    python scripts/step_figures.py --use_moe 1
    python scripts/step_figures.py --use_compile 1 --steps 12 --compile_backend eager

Every flag this script does not know is the trainer's own (train_full_sft.py --help); the
defaults differ only in --batch_size 4 and --dtype bfloat16 (CPU autocast). The step is
trainer/loop/loop.optimizer_step with the trainer's model, loader and fused AdamW (the CUDA
choice); what is counted is described in scripts/_dispatch_counts.py. docs/benchmarks.md records
the figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import ArgumentParser  # noqa: E402
from scripts._dispatch_counts import measure, span  # noqa: E402

DEFAULT_TRAINER_FLAGS = {"--batch_size": "4", "--dtype": "bfloat16"}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], epilog="other flags: the trainer's")
    parser.add_argument("--warmup_steps", type=int, default=1, help="uncounted optimizer steps first (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="counted optimizer steps")
    parser.add_argument("--compile_backend", default="inductor",
                        help="torch.compile backend with --use_compile 1 (eager: the same graphs, compiled fast)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return parser


def trainer_argv(unknown: list[str]) -> list[str]:
    given = {arg.split("=")[0] for arg in unknown if arg.startswith("--")}
    defaults = [part for flag, value in DEFAULT_TRAINER_FLAGS.items() if flag not in given for part in (flag, value)]
    return defaults + unknown


def main(argv=None) -> int:
    options, unknown = build_parser().parse_known_args(argv)
    if options.warmup_steps < 1 or options.steps < 1:
        build_parser().error("--warmup_steps and --steps must be at least 1")
    flags = trainer_argv(unknown)
    figures = measure(flags, options.warmup_steps, options.steps, options.compile_backend)
    if options.json:
        print(json.dumps({"flags": flags, **vars(figures)}))
        return 0
    print(f"trainer flags: {' '.join(flags)}")
    print(f"per optimizer step ({options.steps} counted after {options.warmup_steps} warm-up): "
          f"aten ops {span(figures.ops)} (with views {span(figures.dispatches)}), casts (_to_copy) "
          f"{span(figures.casts)}, "
          f"GFLOP {min(figures.flops) / 1e9:.2f}-{max(figures.flops) / 1e9:.2f}")
    if figures.frames is not None:
        print(f"torch.compile ({options.compile_backend}): graph breaks {figures.graph_breaks}, frames compiled "
              f"{figures.frames}, recompiles after the first step {figures.recompiles}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
