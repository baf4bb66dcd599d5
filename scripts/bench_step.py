"""`python scripts/bench.py --step_compare`: the trainer's CPU optimizer step, variant against
variant, in one process.

Every variant gets its own model and AdamW from the same seed and the same batches of the
trainer's loader (the mode of --modes' first entry, default the trainer's length-grouped one); the
timed steps alternate one step of each variant in turn, so that the machine's load hits all alike.
A variant is the trainer's `optimizer_step` with these pieces:

  before    the previous wave: the gradient norm's finite check only (one `bool()`), no check of
            the weights after an update, the LM loss without a per-token buffer
  now       the code this wave started from: after every applied update the weights' finite
            check (`torch._foreach_norm(weights, inf)` over every parameter, read with the next
            step's flag), the chunked LM loss filling a per-token buffer on every call
  new       this code (`trainer/loop/loop.py`, `model/loss.py`): no host read in the step, no weights
            check per step (one `aminmax` per parameter at log lines, saves and evaluations:
            trainer/loop/health.py), the per-token buffer only when asked for

The figures: seconds per step of each variant (the median and the mean of its timed steps, the
sum) and, step by step, its time over `before`'s on the same batch (the median and quartiles of
those ratios: the batches differ in length, so only same-batch ratios compare); with --steps 20
and --batch_size 16, 320 conversations per variant (the issue's figure). Then the finite-weights
check alone, as it was and as it is, timed alternately. The final weights of the three must be
equal (the checks and the buffer change no arithmetic of the update): printed.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time

import torch

import model.modeling_minimind as modeling
import trainer.loop.health as health

VARIANTS = ("before", "now", "new")


def _chunked_with_buffer(real):
    """The chunked LM loss as the wave started: the per-token values computed on every call."""
    def chunked(hidden, weight, targets, chunk_tokens, token_losses=False):
        total, per_token = real(hidden, weight, targets, chunk_tokens, token_losses=True)
        return (total, per_token) if token_losses else total
    return chunked


@torch.no_grad()
def _weights_check_now(run) -> torch.Tensor:
    """`non_finite_weights` as the wave started: an inf-norm of every parameter, on the device."""
    params = list(run.raw_model.parameters())
    return (~torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf"))).max())).float()


def _check_now(run) -> None:
    """The host read of the wave's start after every step: the weights check (inf-norms)."""
    float(_weights_check_now(run))


# What each variant adds to the trainer's step, inside the timed region.
AFTER_STEP = {"before": lambda run: None, "now": _check_now, "new": lambda run: None}


@contextlib.contextmanager
def variant(name: str):
    """The trainer's LM loss as in variant `name` (module docstring) while inside."""
    saved = modeling.chunked_lm_loss
    try:
        if name == "now":
            modeling.chunked_lm_loss = _chunked_with_buffer(saved)
        yield
    finally:
        modeling.chunked_lm_loss = saved


def run_step_compare(options, tokenizer, machine: str, helpers) -> dict:
    """Time the variants' steps alternately; print the table. `helpers`: scripts/bench.py's
    (trainer_args, build_data, build_run, endless_batches, optimizer_step_once, single_process_context)."""
    trainer_args, build_data, build_run, endless_batches, optimizer_step_once, context = helpers
    ctx = context(torch.device("cpu"))
    mode = options.modes[0] if options.modes[0] != "minimind" else "grouped"
    dtype_name = options.dtypes[0]
    runs = {}
    for name in VARIANTS:
        args = trainer_args(options, mode, dtype_name)
        with contextlib.redirect_stdout(io.StringIO()):
            data = build_data(args, tokenizer, ctx, mode)
        runs[name] = (args, build_run(args, tokenizer, ctx, data, getattr(torch, dtype_name), mode), endless_batches(data))
    seconds = {name: [] for name in VARIANTS}
    for step in range(options.warmup_steps + options.steps):
        for name in VARIANTS:
            args, run, batches = runs[name]
            with variant(name):
                start = time.perf_counter()
                optimizer_step_once(run, batches, args)
                AFTER_STEP[name](run)
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
        ratios = sorted(a / b for a, b in zip(seconds[name], seconds["before"]))  # the same batch, one after the other
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        result = {"variant": name, "median_s": statistics.median(seconds[name]), "mean_s": statistics.fmean(seconds[name]),
                  "total_s": sum(seconds[name]), "ratio_median": statistics.median(ratios),
                  "ratio_quartiles": [quartiles[0], quartiles[2]], "same_weights": same[name], "seconds": seconds[name]}
        results.append(result)
        spread = f"{result['ratio_median']:.3f} ({quartiles[0]:.3f}-{quartiles[2]:.3f})"
        print(f"{name:<8} {result['median_s']:>13.3f} {result['mean_s']:>11.3f} {result['total_s']:>8.1f} {spread:>24}  "
              f"{same[name]}")
    print(f"finite-weights check alone, per call (alternately, {CHECK_CALLS} calls each): now "
          f"{checks['now_ms']:.2f} ms, new {checks['new_ms']:.2f} ms; a median step {results[0]['median_s'] * 1000:.0f} ms")
    summary = (f"summary: {conversations} conversations: before {results[0]['total_s']:.1f} s, now "
               f"{results[1]['total_s']:.1f} s, new {results[2]['total_s']:.1f} s; step / before's on the same batch "
               f"(median): now {results[1]['ratio_median']:.3f}, new {results[2]['ratio_median']:.3f}; the weights check "
               f"{checks['now_ms']:.2f} -> {checks['new_ms']:.2f} ms per step")
    print(summary)
    return {"machine": machine, "step_compare": results, "checks": checks, "summary": summary}


CHECK_CALLS = 50


def _time_checks(run) -> dict:
    """Milliseconds per call of the finite-weights check as the wave started and as now, alternately."""
    totals = {"now": 0.0, "new": 0.0}
    for _ in range(CHECK_CALLS):
        for name, check in (("now", _weights_check_now), ("new", health.non_finite_weights)):
            start = time.perf_counter()
            float(check(run))
            totals[name] += time.perf_counter() - start
    return {f"{name}_ms": 1000 * seconds / CHECK_CALLS for name, seconds in totals.items()}
