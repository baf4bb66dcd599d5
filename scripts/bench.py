"""Training throughput: MiniMind's pad-to-max scheme against the trainer's padding modes.

    python scripts/bench.py --hidden_size 256 --num_hidden_layers 4 --max_seq_len 512 --batch_size 8
    python scripts/bench.py --use_compile both          # every mode eager and compiled

Every (mode, dtype) runs the trainer's own step on its own model from the same seed, in this one
process, the timed steps of all modes interleaved; compare ratios within one run. The modes, the
columns, the FLOP formula, the peak and the memory method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset import IGNORE_INDEX, SFTCollator, build_cache_and_open, load_tokenizer  # noqa: E402
from scripts._bench_common import (  # noqa: E402
    DeviceTimer, add_model_flags, add_run_flags, build_run, check_options, comma_list, first_step_seconds,
    follow_precision_policy, machine_description, memory_in_use_mib, optimizer_step_once, options_record,
    peak_memory_mib, ready_batches, release_memory, reset_peak_memory, single_process_context, synchronize,
    trainer_args, write_report,
)
from model.flops import causal_pairs, mfu, model_flops  # noqa: E402
from scripts._bench_flops import peak_flops  # noqa: E402
from scripts._common import ArgumentParser, fail, resolve_device, run_main  # noqa: E402
from trainer.data_setup import build_train_data  # noqa: E402
from trainer.args import add_flag  # noqa: E402
from trainer.loop.state import Run  # noqa: E402

MODES = ("minimind", "dynamic", "grouped", "packed", "unchunked")
DEFAULT_MODES = MODES[:4]

COLUMNS = [  # (JSON key, header, number format; text columns have none and are left-aligned)
    ("mode", "mode", ""),
    ("dtype", "dtype", ""),
    ("compiled", "compiled", ""),
    ("steps_per_s", "steps/s", ".3f"),
    ("samples_per_s", "samples/s", ".1f"),
    ("computed_tokens_per_s", "comp tok/s", ".0f"),
    ("real_tokens_per_s", "real tok/s", ".0f"),
    ("loss_tokens_per_s", "loss tok/s", ".0f"),
    ("pad_fraction", "pad", ".3f"),
    ("gflop_per_loss_token", "GFLOP/loss tok", ".4f"),
    ("mfu", "MFU", ".1%"),
    ("host_share", "host %", ".0%"),
    ("peak_memory_mib", "peak MiB", ".0f"),
    ("step_memory_mib", "step MiB", ".0f"),
    ("speedup_vs_minimind", "x minimind", ".2f"),
]
TEXT_WIDTH = 9


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Throughput of MiniMind's pad-to-max SFT against the trainer's dynamic, grouped and packed "
                    "modes (fp32 / bf16), model FLOPs and MFU, memory, startup.",
        epilog="Definitions of the modes and columns, the FLOP formula and the peak: docs/benchmarks.md.",
    )
    add_model_flags(parser)
    add_run_flags(parser)
    group = parser.add_argument_group("modes")
    group.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add_flag(group, "--rounds", type=int, default=0, at_least=0,
             help="the timed steps of every mode are cut into this many chunks, run in turn "
                  "(A, B, ..., A, B, ...); 0 = one step per chunk")
    group.add_argument("--use_compile", choices=("0", "1", "both"), default="0",
                       help="1 = torch.compile the model (the trainer's --use_compile 1); both = every mode eager "
                            "and compiled, side by side")
    add_flag(group, "--matmul_size", type=int, default=None, at_least=1,
             help="side of the square matmul that measures the peak where no datasheet gives it "
                  "(default: 2048 on CPU, 8192 on a GPU)")
    return parser


def parse_options(argv=None) -> argparse.Namespace:
    parser = build_parser()
    options = check_options(parser, parser.parse_args(argv))  # the ranges: checked by parse_args
    options.modes = comma_list(parser, options.modes, MODES, "mode", "--modes")
    options.rounds = options.rounds or options.steps
    return options


class MiniMindObjective(torch.nn.Module):
    """MiniMind's loss on top of the model: full [B, T, V] logits, mean per micro-batch / accumulation.

    Plugged into the trainer's optimizer_step as `run.model`, which passes `num_items_in_batch`
    and `skip_logits=True`; both are ignored here."""

    def __init__(self, module: torch.nn.Module, accumulation_steps: int):
        super().__init__()
        self.module = module
        self.accumulation_steps = accumulation_steps

    def forward(self, num_items_in_batch=None, skip_logits=True, **inputs):
        out = self.module(**inputs, skip_logits=False)
        out.loss = out.loss / self.accumulation_steps
        return out


def build_mode_data(args, tokenizer, ctx, mode: str):
    """The trainer's TrainData; the minimind mode pads every batch to max_seq_len."""
    data = build_train_data(args, tokenizer, ctx)
    if mode == "minimind":
        loader = DataLoader(
            data.dataset, batch_size=args.batch_size, sampler=data.sampler, num_workers=data.loader.num_workers,
            collate_fn=SFTCollator(pad_token_id=tokenizer.pad_token_id, pad_to_length=args.max_seq_len),
            pin_memory=ctx.device.type == "cuda",
        )
        data = dataclasses.replace(data, loader=loader)
    return data


def samples_in_rows(batch: dict) -> int:
    """Conversations in a micro-batch: a packed row holds several (position 0 starts each)."""
    if "position_ids" in batch:
        return int(((batch["position_ids"] == 0) & (batch["attention_mask"] == 1)).sum())
    return len(batch["input_ids"])


@dataclasses.dataclass
class Counts:
    """Work of the timed steps."""
    samples: int = 0
    computed_tokens: int = 0
    real_tokens: int = 0
    loss_tokens: int = 0
    logit_positions: int = 0
    causal_pairs: int = 0

    def add(self, batch: dict, full_logits: bool) -> None:
        rows, length = batch["input_ids"].shape
        loss_tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        self.samples += samples_in_rows(batch)
        self.computed_tokens += rows * length
        self.real_tokens += int(batch["attention_mask"].sum())
        self.loss_tokens += loss_tokens
        self.logit_positions += rows * length if full_logits else loss_tokens
        self.causal_pairs += causal_pairs(batch)


@dataclasses.dataclass
class ModeRun:
    """One (mode, dtype) under test: the trainer's Run, its batch stream, and what was timed so far."""

    mode: str
    dtype_name: str
    compiled: bool
    args: argparse.Namespace
    run: Run
    batches: Iterator[dict]
    counts: Counts = dataclasses.field(default_factory=Counts)
    steps: int = 0
    seconds: float = 0.0
    host_seconds: float = 0.0  # the host's time to issue the timed steps (no sync inside a step)
    warmup_steps: int = 0
    warmup_seconds: float = 0.0  # includes torch.compile's compilation when compiled
    peak_memory_mib: float = 0.0
    step_memory_mib: float = 0.0  # peak above the memory in use before its memory step


def prepare_mode(options, tokenizer, ctx, mode: str, dtype_name: str, compiled: bool) -> ModeRun:
    """Build the mode's loader, model and optimizer (seeded), run its warm-up steps, then one
    untimed step that measures its peak memory (before the other modes' steps have run)."""
    args = trainer_args(options, dtype_name, packing=mode == "packed", group_by_length=mode == "grouped",
                        compiled=compiled)
    dtype = getattr(torch, dtype_name)
    follow_precision_policy(ctx.device, dtype)
    with contextlib.redirect_stdout(io.StringIO()):  # the dataset's notes, already printed by the startup
        data = build_mode_data(args, tokenizer, ctx, mode)
    objective = (lambda model: MiniMindObjective(model, args.accumulation_steps)) if mode == "minimind" else None
    run = build_run(args, tokenizer, ctx, data, dtype, options.vocab_size, mode != "unchunked", objective)
    mode_run = ModeRun(mode, dtype_name, compiled, args, run, ready_batches(data))
    start = time.perf_counter()
    for _ in range(options.warmup_steps):
        optimizer_step_once(run, mode_run.batches, args)
    extra_steps = warm_up_until_compiled(run, mode_run.batches, args) if compiled else 0
    mode_run.warmup_steps = options.warmup_steps + extra_steps
    synchronize(ctx.device)
    mode_run.warmup_seconds = time.perf_counter() - start
    release_memory()
    reset_peak_memory(ctx.device)
    in_use = memory_in_use_mib(ctx.device)
    optimizer_step_once(run, mode_run.batches, args)
    synchronize(ctx.device)
    mode_run.peak_memory_mib = peak_memory_mib(ctx.device)
    mode_run.step_memory_mib = mode_run.peak_memory_mib - in_use
    # The timed steps start again from the first batch: every variant of a mode (eager and
    # compiled, fp32 and bf16) is timed on the same batches, however long it warmed up.
    mode_run.batches = ready_batches(data)
    return mode_run


def warm_up_until_compiled(run, batches, args, quiet_steps: int = 5, limit: int = 60) -> int:
    """Extra warm-up steps for a compiled model until `quiet_steps` steps in a row compiled no
    new graph: torch.compile specializes on a few ranges of batch length, and a compilation in
    the timed steps would be counted as training time. Returns the number of extra steps."""
    from torch._dynamo.utils import counters

    quiet = extra = 0
    while quiet < quiet_steps and extra < limit:
        graphs = counters["stats"]["unique_graphs"]
        optimizer_step_once(run, batches, args)
        extra += 1
        quiet = quiet + 1 if counters["stats"]["unique_graphs"] == graphs else 0
    return extra


def time_steps(mode_run: ModeRun, steps: int, device) -> None:
    """Time `steps` optimizer steps of one mode (CUDA events on a GPU) and add them to its totals."""
    follow_precision_policy(device, getattr(torch, mode_run.dtype_name))
    timer = DeviceTimer(device)
    synchronize(device)
    timer.start()
    issue_start = time.perf_counter()
    for _ in range(steps):
        for batch in optimizer_step_once(mode_run.run, mode_run.batches, mode_run.args):
            mode_run.counts.add(batch, full_logits=mode_run.mode == "minimind")
    mode_run.host_seconds += time.perf_counter() - issue_start
    mode_run.seconds += timer.stop()
    mode_run.steps += steps


def split_steps(steps: int, rounds: int) -> list[int]:
    """`steps` cut into `rounds` nearly equal chunks (fewer rounds if there are fewer steps)."""
    rounds = min(rounds, steps)
    base, extra = divmod(steps, rounds)
    return [base + (index < extra) for index in range(rounds)]


def mode_result(mode_run: ModeRun, peak: float) -> dict:
    counts, elapsed = mode_run.counts, mode_run.seconds
    flops = model_flops(mode_run.run.raw_model, counts.computed_tokens, counts.logit_positions, counts.causal_pairs)
    return {
        "mode": mode_run.mode,
        "dtype": mode_run.dtype_name,
        "compiled": "yes" if mode_run.compiled else "no",
        "warmup_steps": mode_run.warmup_steps,
        "warmup_s": mode_run.warmup_seconds,
        "steps": mode_run.steps,
        "seconds": elapsed,
        "steps_per_s": mode_run.steps / elapsed,
        "samples_per_s": counts.samples / elapsed,
        "computed_tokens_per_s": counts.computed_tokens / elapsed,
        "real_tokens_per_s": counts.real_tokens / elapsed,
        "loss_tokens_per_s": counts.loss_tokens / elapsed,
        "pad_fraction": 1 - counts.real_tokens / counts.computed_tokens,
        "gflop_per_loss_token": flops / max(counts.loss_tokens, 1) / 1e9,
        "mfu": mfu(flops, elapsed, peak),
        # Near 1 on a GPU: the device waited for the host to issue the step (host-bound).
        "host_share": mode_run.host_seconds / elapsed,
        "peak_memory_mib": mode_run.peak_memory_mib,
        "step_memory_mib": mode_run.step_memory_mib,
        "counts": dataclasses.asdict(counts),
    }


def measure_startup(options, ctx, dtype_name: str) -> dict:
    """Seconds to the end of the first optimizer step (dynamic mode) with a fresh and an existing cache."""
    figures = {}
    start = time.perf_counter()
    tokenizer = load_tokenizer(None)
    figures["tokenizer_s"] = time.perf_counter() - start
    fresh_cache = tempfile.mkdtemp(prefix="minisft-bench-cache-")
    try:
        start = time.perf_counter()
        build_cache_and_open(options.data_path, tokenizer, options.max_seq_len, cache_dir=fresh_cache)
        figures["dataset_fresh_cache_s"] = time.perf_counter() - start
        args = trainer_args(options, dtype_name, group_by_length=False, cache_dir=fresh_cache)
        first = first_step_seconds(args, tokenizer, ctx, getattr(torch, dtype_name), options.vocab_size)
        figures.update(dataset_existing_cache_s=first["dataset_s"], model_build_s=first["model_build_s"],
                       first_step_s=first["first_step_s"])
    finally:
        shutil.rmtree(fresh_cache, ignore_errors=True)
    common = figures["tokenizer_s"] + figures["model_build_s"] + figures["first_step_s"]
    figures["to_first_step_fresh_cache_s"] = common + figures["dataset_fresh_cache_s"]
    figures["to_first_step_existing_cache_s"] = common + figures["dataset_existing_cache_s"]
    return figures


def format_row(row: dict) -> str:
    cells = []
    for key, header, number_format in COLUMNS:
        if number_format:
            cells.append(format(row[key], number_format).rjust(max(len(header), 8)))
        else:
            cells.append(str(row[key]).ljust(TEXT_WIDTH))
    return "  ".join(cells)


def format_header() -> str:
    return "  ".join(header.rjust(max(len(header), 8)) if number_format else header.ljust(TEXT_WIDTH)
                     for _, header, number_format in COLUMNS)


def run_modes(options) -> dict:
    device = resolve_device(options.device)
    options.device = str(device)
    options.matmul_size = options.matmul_size or (8192 if device.type == "cuda" else 2048)
    ctx = single_process_context(device)
    if device.type == "cpu" and "float16" in options.dtypes:
        fail("--dtypes float16 needs a GPU; on CPU use float32 or bfloat16")
    peak_reset_works = reset_peak_memory(device)
    print(f"machine: {machine_description(device)}")
    print(f"config: hidden {options.hidden_size}, layers {options.num_hidden_layers}, vocab "
          f"{options.vocab_size or 'of the tokenizer'}, max_seq_len "
          f"{options.max_seq_len}, batch {options.batch_size} x accumulation {options.accumulation_steps}, "
          f"{options.warmup_steps} warm-up + {options.steps} timed optimizer steps per mode in {options.rounds} rounds, "
          f"compile {options.use_compile}, data {options.data_path}")
    print("timing: CUDA events; float32 matmuls in IEEE float32 (no TF32), TF32 only beside bf16/fp16 autocast"
          if device.type == "cuda" else "timing: host clock")

    follow_precision_policy(device, getattr(torch, options.dtypes[0]))
    startup = measure_startup(options, ctx, options.dtypes[0])
    print("startup (in-process, import torch excluded): tokenizer {tokenizer_s:.2f} s, dataset fresh cache "
          "{dataset_fresh_cache_s:.2f} s / existing cache {dataset_existing_cache_s:.3f} s, model+optimizer "
          "{model_build_s:.2f} s, first step {first_step_s:.2f} s -> to first step: fresh cache "
          "{to_first_step_fresh_cache_s:.2f} s, existing cache {to_first_step_existing_cache_s:.2f} s".format(**startup))

    peaks = {}
    for name in options.dtypes:
        follow_precision_policy(device, getattr(torch, name))
        peaks[name] = peak_flops(device, name, options.matmul_size)
        print(f"peak {name}: {peaks[name][0] / 1e9:.1f} GFLOP/s ({peaks[name][1]})")

    tokenizer = load_tokenizer(None)
    variants = {"0": [False], "1": [True], "both": [False, True]}[options.use_compile]
    if True in variants:
        # Every compiled model here is another instance of the same forward code, which counts
        # against dynamo's per-function recompile limit (8): without this, the last ones would
        # silently run eager.
        torch._dynamo.config.recompile_limit = 16 * len(options.modes) * len(options.dtypes)
    mode_runs = [prepare_mode(options, tokenizer, ctx, mode, dtype_name, compiled)
                 for dtype_name in options.dtypes for mode in options.modes for compiled in variants]
    # Interleaved rounds: a change in the machine's background load hits every mode alike.
    for round_steps in split_steps(options.steps, options.rounds):
        for mode_run in mode_runs:
            time_steps(mode_run, round_steps, device)
    rows = [mode_result(mode_run, peaks[mode_run.dtype_name][0]) for mode_run in mode_runs]
    baseline_compiled = rows[0]["compiled"]  # the first variant: eager, unless only compiled ran
    for row in rows:
        baseline = next((other for other in rows if other["mode"] == "minimind" and other["dtype"] == row["dtype"]
                         and other["compiled"] == baseline_compiled), None)
        row["speedup_vs_minimind"] = row["loss_tokens_per_s"] / baseline["loss_tokens_per_s"] if baseline else float("nan")
    print()
    print(format_header())
    for row in rows:
        print(format_row(row))
    if not peak_reset_works:
        print("note: peak memory is the lifetime peak of this process (it could not be reset per mode)")
    if device.type == "cpu":
        print("note: minimind syncs gradients on every micro-step; in one process that costs nothing")

    summary = summarize(rows)
    print(summary)
    return {
        "machine": machine_description(device),
        "device": str(device),
        "options": options_record(options),
        "flop_formula": "6*N_body*computed_tokens + 6*hidden*vocab*logit_positions + 12*layers*heads*head_dim*causal_pairs",
        "peak_flops": {name: flops for name, (flops, _) in peaks.items()},
        "peak_source": {name: source for name, (_, source) in peaks.items()},
        "startup": startup,
        "results": rows,
        "summary": summary,
    }


def summarize(rows: list[dict]) -> str:
    """One line: the best mode and its loss-token speed-up over minimind (same dtype), bf16 vs fp32,
    and with --use_compile both, compiled vs eager (with the warm-up time compilation costs)."""
    best = max(rows, key=lambda row: row["loss_tokens_per_s"])
    compiled_note = " compiled" if best["compiled"] == "yes" else ""
    parts = [f"best {best['mode']} {best['dtype']}{compiled_note}: {best['loss_tokens_per_s']:.0f} loss tok/s"]
    if best["speedup_vs_minimind"] == best["speedup_vs_minimind"]:  # not NaN
        parts.append(f"{best['speedup_vs_minimind']:.2f}x minimind {best['dtype']}")
    speed = {(row["mode"], row["dtype"], row["compiled"]): row["loss_tokens_per_s"] for row in rows}
    warmup = {(row["mode"], row["dtype"], row["compiled"]): row["warmup_s"] for row in rows}
    first = rows[0]["compiled"]
    ratios = [f"{mode} {speed[(mode, 'bfloat16', first)] / speed[(mode, 'float32', first)]:.2f}"
              for mode in MODES if (mode, "bfloat16", first) in speed and (mode, "float32", first) in speed]
    if ratios:
        parts.append("bf16/fp32 loss tok/s: " + ", ".join(ratios))
    gains = [f"{mode} {dtype} {speed[(mode, dtype, 'yes')] / speed[(mode, dtype, 'no')]:.2f} "
             f"(warm-up {warmup[(mode, dtype, 'yes')]:.0f} s vs {warmup[(mode, dtype, 'no')]:.0f} s eager)"
             for (mode, dtype, compiled) in speed if compiled == "no" and (mode, dtype, "yes") in speed]
    if gains:
        parts.append("compiled/eager loss tok/s: " + ", ".join(gains))
    return "summary: " + "; ".join(parts)


def main(argv=None) -> int:
    options = parse_options(argv)
    write_report(options, run_modes(options))
    return 0


if __name__ == "__main__":
    run_main(main)
