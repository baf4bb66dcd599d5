"""What a GPU does in the trainer's step: host syncs, kernels per step, idle gaps, which attention
kernels run, the GPU time of each aten op, graph breaks and recompiles under torch.compile.

    python scripts/profile_step.py --hidden_size 768 --num_hidden_layers 8 --max_seq_len 2048 --mode packed
    python scripts/profile_step.py --mode dynamic --use_compile 1 --trace step.json

One mode of scripts/bench.py (same model, data and step), warmed up, then `--steps` optimizer
steps under torch.profiler. A host sync is any call that makes the CPU wait for the GPU
(torch.cuda.set_sync_debug_mode); "GPU busy" is the union of kernel intervals over the wall
time of the profiled steps, so 1 - busy is the GPU's idle share. Where the GPU idles, the host
is the bound: the host ops by self CPU time, and the share of the wall time spent inside aten
ops at all (the rest is Python and the launches' own cost), say where its time goes. Where the
GPU is busy, the ops by their own GPU time (`--op_shapes 1`: split by input shapes) set against
`scripts/step_figures.py --bytes --by_shapes` for the same flags say which ops run below their
roofline estimate; `--roofline 1` prints each op's GPU time beside that estimate (the step traced
on the CPU here, joined by op name: scripts/_step_bytes.py profile_key).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset import load_tokenizer  # noqa: E402
from scripts._bench_common import (  # noqa: E402
    add_model_flags, add_run_flags, optimizer_step_once, single_process_context, synchronize, trainer_argv,
)
from scripts._common import ArgumentParser, check_output_file, fail, resolve_device, run_main  # noqa: E402
from trainer.runtime.datasheets import datasheet_for  # noqa: E402
from scripts._step_bytes import ESTIMATE_CARD, measure_bytes, profile_key  # noqa: E402
from scripts.bench import MODES, prepare_mode  # noqa: E402
from trainer.args import add_flag  # noqa: E402

ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "varlen", "sdpa")
TRAINER_MODES = ("dynamic", "grouped", "packed")  # the modes that run the trainer's own step


def parse_options(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    add_run_flags(parser, dtypes="bfloat16")
    parser.add_argument("--mode", choices=MODES, default="packed")
    parser.add_argument("--use_compile", type=int, choices=(0, 1), default=0)
    add_flag(parser, "--top", type=int, default=12, at_least=1, help="kernels and ops listed, by GPU time")
    parser.add_argument("--op_shapes", type=int, choices=(0, 1), default=0,
                        help="1 = the aten ops' table split by their inputs' shapes (records shapes while profiling)")
    parser.add_argument("--roofline", type=int, choices=(0, 1), default=0,
                        help="1 = also trace the same step on the CPU (scripts/_step_bytes.py) and print each op's "
                             "GPU time beside its roofline estimate (eager, modes dynamic, grouped and packed)")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    options = parser.parse_args(argv)
    check_output_file(options.trace, "--trace")  # before the profile, not after it
    options.dtypes = options.dtypes.split(",")
    if len(options.dtypes) != 1:
        fail("--dtypes: one dtype per profile")
    if options.roofline and (options.use_compile or options.mode not in TRAINER_MODES or options.vocab_size):
        fail("--roofline sets the trainer's eager step against its trace: give --use_compile 0, no --vocab_size "
             "and a --mode of " + ", ".join(TRAINER_MODES))
    return options


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def host_sync_report(run, batches, args) -> str:
    """'none' or the first sync's message, over one optimizer step (after warm-up)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer_step_once(run, batches, args)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "none"


def host_report(averages, steps: int, wall: float, top: int) -> list[str]:
    """Lines on the host's time from `profile.key_averages()`: the share of `wall` spent in aten
    ops (the self times of its `aten::` events), then the `top` ops by self CPU time."""
    aten_self = sum(event.self_cpu_time_total for event in averages if event.key.startswith("aten::")) / 1e6
    lines = [f"host: {aten_self / wall:.1%} of the wall time inside aten ops' own code "
             f"({aten_self / steps * 1e3:.2f} ms per step)",
             f"top {top} host ops by self CPU time (ms per step, calls per step):"]
    ranked = sorted(averages, key=lambda event: -event.self_cpu_time_total)[:top]
    lines += [f"  {event.self_cpu_time_total / 1e3 / steps:8.3f}  {event.count / steps:6.1f}  {event.key[:100]}"
              for event in ranked]
    return lines


def gpu_op_report(averages, steps: int, top: int) -> list[str]:
    """Lines on the GPU's time by the aten op that launched it, from `profile.key_averages()`
    (grouped by input shape or not): the `top` ops by self GPU time. The kernels' own entries, which
    hold the same time again, are left out. Set beside `scripts/step_figures.py
    --bytes [--by_shapes]`, the same step's roofline estimate per op, it says which ops run far
    below their estimate."""
    ops = (e for e in averages if e.device_type == DeviceType.CPU and e.self_device_time_total > 0)  # not kernels
    ranked = sorted(ops, key=lambda e: -e.self_device_time_total)
    with_shapes = any(e.input_shapes for e in ranked)
    lines = [f"top {top} ops by their own GPU time (ms per step, calls per step"
             f"{', input shapes' if with_shapes else ''}):"]
    for event in ranked[:top]:
        shapes = " ".join(str(shape) for shape in event.input_shapes or [] if shape)
        line = f"  {event.self_device_time_total / 1e3 / steps:8.3f}  {event.count / steps:6.1f}  {event.key[:60]}"
        lines.append(f"{line}  {shapes}" if shapes else line)
    return lines


def roofline_report(events, counter, steps: int, top: int) -> list[str]:
    """Lines: each op's own GPU time per step (`events`: `profile.events()` of `steps` steps) beside
    the roofline estimate of the same op in a trace of the same steps (`counter`, a
    scripts/_step_bytes.ByteCounter of `steps` steps), joined by `profile_key`, the `top` ops by GPU
    time, then all ops: a ratio far above 1 is an op running far below its bandwidth or tensor-core
    peak. An op's GPU time goes to the nearest op on its call path that the trace has (a zero fill
    to `zeros`, FlashAttention to the varlen attention op that calls it); "-": none has. The batch's
    copies to the GPU, which the trace leaves out, count under copy_ with the casts."""
    estimated: dict[str, float] = {}
    for name, traffic in counter.groups.items():
        estimated[profile_key(name)] = estimated.get(profile_key(name), 0.0) + traffic.seconds * 1e3 / steps

    def traced_owner(event) -> str:
        caller = event
        while caller is not None and profile_key(caller.key) not in estimated:
            caller = caller.cpu_parent
        return profile_key((caller or event).key)

    measured: dict[str, float] = {}
    for event in events:
        if event.device_type == DeviceType.CPU and event.self_device_time_total > 0:  # ops, not kernels
            name = traced_owner(event)
            measured[name] = measured.get(name, 0.0) + event.self_device_time_total / 1e3 / steps

    def line(gpu: float, estimate: float | None, name: str) -> str:
        if estimate is None:
            return f"  {gpu:8.3f} {'-':>8} {'-':>8}  {name}"
        return f"  {gpu:8.3f} {estimate:8.3f} {gpu / estimate:8.2f}  {name}"

    lines = ["ops by their own GPU time against the step's roofline estimate, ms per step:",
             f"  {'GPU':>8} {'estimate':>8} {'ratio':>8}  op"]
    ranked = sorted(measured, key=lambda name: -measured[name])[:top]
    lines += [line(measured[name], estimated.get(name), name) for name in ranked]
    lines.append(line(sum(measured.values()), counter.total.seconds * 1e3 / steps, "all ops"))
    return lines


def main(argv=None) -> int:
    options = parse_options(argv)
    device = resolve_device(options.device)
    if device.type != "cuda":
        fail("profile_step.py profiles a CUDA GPU; this machine has none (--device cuda)")
    options.device = str(device)
    ctx = single_process_context(device)
    from torch._dynamo.utils import counters
    counters.clear()
    mode_run = prepare_mode(options, load_tokenizer(None), ctx, options.mode, options.dtypes[0],
                            bool(options.use_compile))
    run, batches, args = mode_run.run, mode_run.batches, mode_run.args
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; mode {options.mode}, "
          f"{options.dtypes[0]}, compile {options.use_compile}, hidden {options.hidden_size} x "
          f"{options.num_hidden_layers} layers, max_seq_len {options.max_seq_len}, batch {options.batch_size}")
    print(f"host syncs inside a step: {host_sync_report(run, batches, args)}")
    frames_before = counters["frames"]["ok"]

    synchronize(device)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, record_shapes=bool(options.op_shapes)) as prof:
        start = time.perf_counter()
        for _ in range(options.steps):
            optimizer_step_once(run, batches, args)
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_time > 0]
    intervals = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in kernels]
    busy = busy_seconds(intervals)
    print(f"{options.steps} steps: {wall / options.steps * 1e3:.2f} ms/step, {len(kernels) / options.steps:.0f} "
          f"GPU kernels/step, GPU busy {busy / wall:.1%} of wall (idle {1 - busy / wall:.1%})")
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        by_name.setdefault(event.name, []).append(event.device_time / 1e3)
    attention = sorted(n for n in by_name if any(w in n.lower() for w in ATTENTION_WORDS))
    print("attention kernels: " + ("; ".join(n[:90] for n in attention) or "none matched"))
    print(f"top {options.top} kernels by GPU time (ms per step, calls per step):")
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:options.top]
    for name, times in ranked:
        print(f"  {sum(times) / options.steps:8.3f}  {len(times) / options.steps:6.1f}  {name[:100]}")
    averages = prof.key_averages()
    by_shapes = prof.key_averages(group_by_input_shape=True) if options.op_shapes else averages
    print("\n".join(gpu_op_report(by_shapes, options.steps, options.top)))
    print("\n".join(host_report(averages, options.steps, wall, options.top)))
    if options.roofline:  # the batches profiled: the second to the (steps + 1)th (the first checked the syncs)
        card = datasheet_for(torch.cuda.get_device_name(device)) or ESTIMATE_CARD
        argv = trainer_argv(options, options.dtypes[0], packing=options.mode == "packed",
                            group_by_length=options.mode == "grouped")
        counter = measure_bytes(argv, steps=options.steps, card=card)
        print(f"roofline of the {card.name}'s datasheet: {card.memory} TB/s, "
              f"{counter.peak / 1e12:.1f} TFLOP/s ({options.dtypes[0]})")
        print("\n".join(roofline_report(prof.events(), counter, options.steps, options.top)))
    if options.use_compile:
        print(f"torch.compile: graph breaks {sum(counters['graph_break'].values())}, frames compiled "
              f"{counters['frames']['ok']}, compiled during the profiled steps {counters['frames']['ok'] - frames_before}")
        for reason, count in list(counters["graph_break"].items())[:5]:
            print(f"  break x{count}: {reason[:140]}")
    if options.trace:
        Path(options.trace).absolute().parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(options.trace)
        print(f"trace: {options.trace}")
    return 0


if __name__ == "__main__":
    run_main(main)
