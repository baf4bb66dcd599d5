"""The cost of the trainer's finite checks in its CPU optimizer step, variant against variant.

    python scripts/bench_step.py --hidden_size 256 --num_hidden_layers 4 --max_seq_len 1024 --batch_size 16 --steps 20

Every variant gets its own model and AdamW from the same seed and the same batches of the
trainer's loader; one step of each variant runs in turn, so the machine's load hits all alike.
The variants are the trainer's `optimizer_step` with these pieces:

  before  the gradient norm's finite check only (one `bool()`), no check of the weights after an
          update, the LM loss without a per-token buffer
  now     after every applied update the weights' finite check as an inf-norm of every parameter
          (`torch._foreach_norm(weights, inf)`, read with the next step's flag), and the chunked
          LM loss filling a per-token buffer on every call
  new     the trainer's code: the weights' check from one `aminmax` per parameter, the per-token
          buffer only when asked for

Figures (seconds per step, same-batch ratios to before's, the check alone) and how to read
them: docs/benchmarks.md. The final weights of the three must be equal (the checks and the
buffer change no arithmetic of the update): printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model.modeling_minimind as modeling  # noqa: E402
import trainer.loop.loop as loop  # noqa: E402
from dataset import load_tokenizer  # noqa: E402
from scripts._bench_common import (  # noqa: E402
    add_model_flags, add_run_flags, build_run, check_options, endless_batches, machine_description,
    optimizer_step_once, single_process_context, trainer_args, write_report,
)
from scripts._common import ArgumentParser  # noqa: E402
from trainer.data_setup import build_train_data  # noqa: E402

VARIANTS = ("before", "now", "new")
CHECK_CALLS = 50


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description="Seconds per CPU optimizer step of the trainer with and without its "
                                        "finite checks, one step of each variant in turn.",
                            epilog="Variants: the module docstring; figures: docs/benchmarks.md.")
    add_model_flags(parser)
    add_run_flags(parser, dtypes="float32", device=False)
    parser.add_argument("--mode", choices=("dynamic", "grouped", "packed"), default="grouped",
                        help="the trainer's batching: dynamic padding, length-grouped (its default) or packed")
    return parser


def parse_options(argv=None) -> argparse.Namespace:
    parser = build_parser()
    options = check_options(parser, parser.parse_args(argv), positive=("steps",))
    options.device = "cpu"  # the question is the CPU step's
    return options


def _chunked_with_buffer(real):
    """The chunked LM loss filling its per-token values on every call."""
    def chunked(hidden, weight, targets, chunk_tokens, token_losses=False):
        total, per_token = real(hidden, weight, targets, chunk_tokens, token_losses=True)
        return (total, per_token) if token_losses else total
    return chunked


@torch.no_grad()
def _weights_check_inf_norm(run) -> torch.Tensor:
    """`non_finite_weights` as an inf-norm of every parameter, on the device."""
    params = list(run.raw_model.parameters())
    return (~torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf"))).max())).float()


def _read_step_flags_now(run, grad_norm) -> bool:
    check, run.weights_check = run.weights_check, None
    bad = check.bad if check is not None else torch.zeros((), device=grad_norm.device)
    finite, weights_bad = torch.stack([torch.isfinite(grad_norm).float(), bad.float()]).tolist()
    if weights_bad:
        loop.raise_non_finite_weights(run, check.step)
    return bool(finite)


def _read_step_flags_before(run, grad_norm) -> bool:
    run.weights_check = None
    return bool(torch.isfinite(grad_norm))


@contextlib.contextmanager
def variant(name: str):
    """The trainer's step as in variant `name` (module docstring) while inside."""
    saved = loop.non_finite_weights, loop.read_step_flags, modeling.chunked_lm_loss
    try:
        if name == "before":
            loop.non_finite_weights = lambda run: None
            loop.read_step_flags = _read_step_flags_before
        elif name == "now":
            loop.non_finite_weights = _weights_check_inf_norm
            loop.read_step_flags = _read_step_flags_now
            modeling.chunked_lm_loss = _chunked_with_buffer(saved[2])
        yield
    finally:
        loop.non_finite_weights, loop.read_step_flags, modeling.chunked_lm_loss = saved


def run_step_compare(options, tokenizer, machine: str) -> dict:
    """Time the variants' steps alternately; print the table."""
    ctx = single_process_context(torch.device("cpu"))
    mode, dtype_name = options.mode, options.dtypes[0]
    runs = {}
    for name in VARIANTS:
        args = trainer_args(options, dtype_name, packing=mode == "packed", group_by_length=mode == "grouped")
        with contextlib.redirect_stdout(io.StringIO()):
            data = build_train_data(args, tokenizer, ctx)
        runs[name] = (args, build_run(args, tokenizer, ctx, data, getattr(torch, dtype_name), options.vocab_size),
                      endless_batches(data))
    seconds = {name: [] for name in VARIANTS}
    for step in range(options.warmup_steps + options.steps):
        for name in VARIANTS:
            args, run, batches = runs[name]
            with variant(name):
                start = time.perf_counter()
                optimizer_step_once(run, batches, args)
                elapsed = time.perf_counter() - start
            if step >= options.warmup_steps:
                seconds[name].append(elapsed)
    checks = _time_checks(runs["new"][1])
    weights = {name: [p.detach().clone() for p in runs[name][1].raw_model.parameters()] for name in VARIANTS}
    same = {name: all(torch.equal(a, b) for a, b in zip(weights["before"], weights[name])) for name in VARIANTS}
    rows = conversations = options.steps * options.batch_size * options.accumulation_steps
    print(f"machine: {machine}")
    print(f"step_compare: mode {mode}, {dtype_name}, hidden {options.hidden_size}, layers {options.num_hidden_layers}, "
          f"batch {options.batch_size} x accumulation {options.accumulation_steps}, max_seq_len {options.max_seq_len}, "
          f"{options.warmup_steps} warm-up + {options.steps} timed steps per variant ({rows} conversations), "
          f"one step of each variant in turn; torch threads {torch.get_num_threads()}")
    print(f"{'variant':<8} {'median s/step':>13} {'mean s/step':>11} {'total s':>8} {'step / before':>24}  "
          "weights equal to before's")
    results = []
    for name in VARIANTS:
        ratios = sorted(a / b for a, b in zip(seconds[name], seconds["before"]))  # the same batch, in turn
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        result = {"variant": name, "median_s": statistics.median(seconds[name]), "mean_s": statistics.fmean(seconds[name]),
                  "total_s": sum(seconds[name]), "ratio_median": statistics.median(ratios),
                  "ratio_quartiles": [quartiles[0], quartiles[2]], "same_weights": same[name], "seconds": seconds[name]}
        results.append(result)
        spread = f"{result['ratio_median']:.3f} ({quartiles[0]:.3f}-{quartiles[2]:.3f})"
        print(f"{name:<8} {result['median_s']:>13.3f} {result['mean_s']:>11.3f} {result['total_s']:>8.1f} "
              f"{spread:>24}  {same[name]}")
    print(f"finite-weights check alone, per call (alternately, {CHECK_CALLS} calls each): now "
          f"{checks['now_ms']:.2f} ms, new {checks['new_ms']:.2f} ms; a median step {results[0]['median_s'] * 1000:.0f} ms")
    summary = (f"summary: {conversations} conversations: before {results[0]['total_s']:.1f} s, now "
               f"{results[1]['total_s']:.1f} s, new {results[2]['total_s']:.1f} s; step / before's on the same batch "
               f"(median): now {results[1]['ratio_median']:.3f}, new {results[2]['ratio_median']:.3f}; the weights check "
               f"{checks['now_ms']:.2f} -> {checks['new_ms']:.2f} ms per step")
    print(summary)
    return {"machine": machine, "step_compare": results, "checks": checks, "summary": summary}


def _time_checks(run) -> dict:
    """Milliseconds per call of the finite-weights check, as an inf-norm (now) and the trainer's (new), alternately."""
    totals = {"now": 0.0, "new": 0.0}
    for _ in range(CHECK_CALLS):
        for name, check in (("now", _weights_check_inf_norm), ("new", loop.non_finite_weights)):
            start = time.perf_counter()
            float(check(run))
            totals[name] += time.perf_counter() - start
    return {f"{name}_ms": 1000 * seconds / CHECK_CALLS for name, seconds in totals.items()}


def main(argv=None) -> int:
    options = parse_options(argv)
    report = run_step_compare(options, load_tokenizer(None), machine_description(torch.device("cpu")))
    write_report(options, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
