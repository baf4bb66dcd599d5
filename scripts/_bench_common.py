"""What the benchmark scripts share: their common flags, the trainer's own pieces run in one
process (flags, loader, model and optimizer, one optimizer step), a device timer, memory readings
and the machine's description. The figures and their definitions: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import json
import os
import platform
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from scripts._common import check_output_file, fail, write_output
from trainer.args import DEFAULT_TRAIN_DATA, add_flag, flag_bounds, parse_args
from trainer.data_setup import build_train_data
from trainer.loop.loop import agree_on_step, optimizer_step
from trainer.loop.state import Run
from trainer.model_setup import build_model, build_model_config, build_optimizer, compile_model
from trainer.parallel.ddp import Replicated
from trainer.runtime.distributed import DistContext
from trainer.runtime.kernels import prefer_flash_attention
from trainer.runtime.precision import apply_tf32_policy, build_grad_scaler
from trainer.runtime.preemption import PreemptionFlag
from trainer.runtime.seeding import setup_seed

DTYPE_NAMES = ("float32", "bfloat16", "float16")
MIB = 1024 * 1024


# --------------------------------------------------------------------------- flags


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model's size and the data: the trainer's flags of the same names, with its ranges."""
    model = parser.add_argument_group("model and data")
    model.add_argument("--hidden_size", type=int, default=256,
                       help="the model's width").bounds = flag_bounds("hidden_size")
    model.add_argument("--num_hidden_layers", type=int, default=4,
                       help="blocks").bounds = flag_bounds("num_hidden_layers")
    model.add_argument("--max_seq_len", type=int, default=512,
                       help="rows are cut to this many tokens, as in training").bounds = flag_bounds("max_seq_len")
    model.add_argument("--use_moe", type=int, choices=(0, 1), default=0,
                       help="1 = the trainer's MoE MLPs (its default experts and top-k); FLOPs count active experts")
    add_flag(model, "--vocab_size", type=int, default=None, at_least=1,
             help="LM head size (default: the tokenizer's); e.g. 151936 for a Qwen3-sized head on the same data")
    model.add_argument("--data_path", default=DEFAULT_TRAIN_DATA, help="SFT jsonl file")
    model.add_argument("--cache_dir", default=None, help="token cache of the timed runs; default: next to the data")


def add_run_flags(parser: argparse.ArgumentParser, dtypes: str = "float32,bfloat16", device: bool = True) -> None:
    """Batch, steps, dtypes, device (unless the script runs on the CPU only), seed and the JSON report;
    the trainer's ranges for the flags it has."""
    run = parser.add_argument_group("run")
    run.add_argument("--batch_size", type=int, default=8, help="rows per micro-batch").bounds = flag_bounds("batch_size")
    run.add_argument("--accumulation_steps", type=int, default=1,
                     help="micro-batches per optimizer step").bounds = flag_bounds("accumulation_steps")
    add_flag(run, "--steps", type=int, default=10, at_least=1, help="timed optimizer steps")
    run.add_argument("--warmup_steps", type=int, default=2,
                     help="untimed optimizer steps before timing").bounds = flag_bounds("warmup_steps")
    run.add_argument("--dtypes", default=dtypes, help="comma-separated: float32, bfloat16, float16 (GPU)")
    if device:
        run.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    run.add_argument("--seed", type=int, default=42, help="the trainer's --seed").bounds = flag_bounds("seed")
    run.add_argument("--json_out", default=None, help="also write every figure to this JSON file")


def comma_list(parser: argparse.ArgumentParser, text: str, allowed, what: str, flag: str) -> list[str]:
    """A comma-separated flag value as a list; an entry outside `allowed`, or none at all, is a parser error."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown:
        parser.error(f"unknown {what}: {', '.join(unknown)}")
    if not items:
        parser.error(f"{flag} needs at least one entry")
    return items


def check_options(parser: argparse.ArgumentParser, options: argparse.Namespace) -> argparse.Namespace:
    """The shared flags checked and normalised: dtypes as a list, the data path absolute, --json_out
    writable before the run rather than after it (their ranges are the flags' own, checked when they
    are parsed: scripts/_common.ArgumentParser)."""
    options.dtypes = comma_list(parser, options.dtypes, DTYPE_NAMES, "dtype", "--dtypes")
    check_output_file(options.json_out, "--json_out")
    options.data_path = str(Path(options.data_path).resolve())
    if not Path(options.data_path).is_file():
        fail(f"{options.data_path}: data file not found")
    return options


def write_report(options: argparse.Namespace, report: dict) -> None:
    """The report as JSON in `--json_out`, its missing folders created (as check_output_file
    promised at the start)."""
    if options.json_out:
        write_output(options.json_out, json.dumps(report, indent=1))


def options_record(options: argparse.Namespace) -> dict:
    """The flags of the run, for its JSON report (the internal probe flags left out)."""
    return {key: value for key, value in vars(options).items() if not key.startswith("probe")}


# --------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceTimer:
    """Seconds of work on `device` between `start()` and `stop()`: on CUDA two CUDA events on the
    device's stream (the time the GPU took, not when the host had queued the work), on CPU the host
    clock. Host work between the two calls that makes the GPU wait (data loading) is counted."""

    def __init__(self, device: torch.device):
        self.device = device
        self.begin = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self.begin.elapsed_time(end) / 1000  # elapsed_time: milliseconds
        return time.perf_counter() - self.begin


def release_memory() -> None:
    """Free what the previous run left: Python garbage, the CUDA cache, glibc's free lists."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def proc_status_kib(field: str) -> int | None:
    """A ``VmXXX`` line of /proc/self/status in KiB (None where there is no /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, else ru_maxrss (KiB on Linux)."""
    high_water = proc_status_kib("VmHWM")
    return (high_water if high_water is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window; False where only the lifetime peak is available."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def memory_in_use_mib(device: torch.device) -> float:
    """CUDA: memory_allocated; CPU: current RSS (VmRSS, else 0)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MIB
    return (proc_status_kib("VmRSS") or 0) / 1024


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: max_memory_allocated; CPU: peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    return peak_rss_mib()


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    model_name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
            model_name = names[0] if names else model_name
    return f"{model_name}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


# --------------------------------------------------------------------------- the trainer's pieces


def follow_precision_policy(device: torch.device, dtype: torch.dtype) -> None:
    """The trainer's matmul precision and attention kernels for a run in `dtype` (its policies:
    `--dtype float32` is IEEE float32, TF32 only beside bf16/fp16 autocast; no cuDNN attention)."""
    if device.type == "cuda":
        apply_tf32_policy(dtype)
        prefer_flash_attention()


def trainer_args(options, dtype_name: str = "float32", packing: bool = False, group_by_length: bool = False,
                 cache_dir=None, compiled: bool = False) -> argparse.Namespace:
    """The trainer's own flags (trainer/args.py) for one benchmarked run."""
    return parse_args(trainer_argv(options, dtype_name, packing, group_by_length, cache_dir, compiled))


def trainer_argv(options, dtype_name: str = "float32", packing: bool = False, group_by_length: bool = False,
                 cache_dir=None, compiled: bool = False) -> list[str]:
    """`trainer_args`' command line."""
    argv = [
        "--hidden_size", str(options.hidden_size), "--num_hidden_layers", str(options.num_hidden_layers),
        "--max_seq_len", str(options.max_seq_len), "--batch_size", str(options.batch_size),
        "--accumulation_steps", str(options.accumulation_steps), "--data_path", options.data_path,
        "--packing", str(int(packing)), "--group_by_length", str(int(group_by_length)),
        "--dtype", dtype_name, "--seed", str(options.seed), "--use_compile", str(int(compiled)),
        "--device", str(options.device), "--use_moe", str(options.use_moe),
    ]
    cache_dir = cache_dir or options.cache_dir
    if cache_dir:
        argv += ["--cache_dir", str(cache_dir)]
    return argv


def single_process_context(device: torch.device) -> DistContext:
    return DistContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)


def build_run(args, tokenizer, ctx, data, dtype: torch.dtype, vocab_size: int | None = None,
              chunked_loss: bool = True, objective=None) -> Run:
    """The trainer's Run in one process: model from the seed, AdamW, grad scaler, optional compile.

    `vocab_size`: a bigger LM head (the data's token ids stay below the tokenizer's size);
    `objective`: a module wrapped around the model that computes another loss (its `module` is
    the model, so the trainer's gradient clipping finds the real parameters)."""
    setup_seed(args.seed)
    config = build_model_config(args, tokenizer)
    if vocab_size:
        config.vocab_size = vocab_size
    model = build_model(args, config, ctx.device)
    model.chunk_lm_loss = chunked_loss
    parallel = Replicated(ctx)
    parallel.wrap(model)
    optimizer = build_optimizer(model, args, ctx.device)
    wrapped = objective(model) if objective else model
    if args.use_compile:
        wrapped = compile_model(wrapped, ctx.device)
    run = Run(args, ctx, wrapped, optimizer, build_grad_scaler(ctx.device, dtype), dtype, data,
              eval_sets=[], tokenizer=tokenizer, logger=None, preemption=PreemptionFlag(), parallel=parallel)
    run.model.train()
    return run


def endless_batches(data):
    """Micro-batches of the trainer's loader, epoch after epoch."""
    epoch = 0
    while True:
        data.sampler.set_epoch(epoch)
        yield from data.loader
        epoch += 1


def ready_batches(data) -> Iterator[dict]:
    """`endless_batches` with its first micro-batch already fetched: the loader's worker processes
    are started and their first batch collated before a step is timed, so the first timed step
    does not wait for the loader to start (a later epoch starts its workers inside a step, as in
    training)."""
    batches = endless_batches(data)
    return itertools.chain([next(batches)], batches)


def optimizer_step_once(run: Run, batches, args, reads=None) -> list[dict]:
    """One optimizer step of the trainer (constant learning rate); returns its micro-batches. With
    `reads` (scripts/_host_reads.py's `HostReads`) the step after the ranks' agreement on its counts
    runs under it, with what it moves to the device marked."""
    micro_batches = [next(batches) for _ in range(args.accumulation_steps)]
    totals = agree_on_step(run, micro_batches)
    if reads is None:
        optimizer_step(run, micro_batches, totals, args.learning_rate)
        return micro_batches
    for batch in micro_batches:
        reads.mark_device_inputs(batch)
    with reads:
        optimizer_step(run, micro_batches, totals, args.learning_rate)
    return micro_batches


def first_step_seconds(args, tokenizer, ctx, dtype: torch.dtype, vocab_size: int | None = None) -> dict:
    """Seconds of the trainer's start after the tokenizer: data (from the cache), model and
    optimizer, the first optimizer step."""
    figures = {}
    start = time.perf_counter()
    data = build_train_data(args, tokenizer, ctx)
    figures["dataset_s"] = time.perf_counter() - start
    figures["samples"] = len(data.dataset)
    start = time.perf_counter()
    run = build_run(args, tokenizer, ctx, data, dtype, vocab_size)
    synchronize(ctx.device)
    figures["model_build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    optimizer_step_once(run, endless_batches(data), args)
    synchronize(ctx.device)
    figures["first_step_s"] = time.perf_counter() - start
    return figures
