"""Large files: the token cache build and a restart to the first step, in fresh processes.

    python scripts/bench_scaling.py                                   # 10k and 100k conversations
    python scripts/bench_scaling.py --sizes 100000,1000000 --restarts 3

For synthetic files of --sizes conversations (demo lines resampled, each made unique): the cache
build (seconds, rows/s, rows/s per core, peak RSS of the builder and its workers), then restarts
of the trainer up to its first optimizer step (seconds, peak RSS). Method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset import build_cache_and_open, load_tokenizer  # noqa: E402
from dataset.printable import print_escaped  # noqa: E402
from scripts._bench_common import (  # noqa: E402
    MIB, add_model_flags, check_options, first_step_seconds, machine_description, options_record, peak_rss_mib,
    proc_status_kib, single_process_context, trainer_args, write_report,
)
from scripts._common import REPO_DIR, ArgumentParser, fail, resolve_device, run_main  # noqa: E402
from trainer.args import add_flag, flag_bounds  # noqa: E402

PROBE_PREFIX = "PROBE "
COLUMNS = [  # (JSON key, header, format)
    ("conversations", "conversations", "d"),
    ("data_mib", "data MiB", ".1f"),
    ("tokens", "tokens", "d"),
    ("cache_build_s", "build s", ".1f"),
    ("cache_build_rows_per_s", "build rows/s", ".0f"),
    ("cache_build_rows_per_core_s", "per core", ".0f"),
    ("cache_build_peak_rss_mib", "build RSS MiB", ".0f"),
    ("cache_build_workers_peak_rss_mib", "workers RSS MiB", ".0f"),
    ("restart_s", "restart s (each)", ""),
    ("restart_dataset_s", "dataset s", ".3f"),
    ("restart_peak_rss_mib", "restart RSS MiB", ".0f"),
    ("cache_mib", "cache MiB", ".1f"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description="Token cache build and restart to the first step (seconds, peak RSS) for "
                                        "synthetic data sets of growing size, each in a fresh process.",
                            epilog="Method and figures: docs/benchmarks.md.")
    add_model_flags(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--sizes", default="10000,100000", help="numbers of synthetic conversations")
    add_flag(run, "--restarts", type=int, default=3, at_least=1, help="restart measurements per size")
    run.add_argument("--batch_size", type=int, default=8,
                     help="rows per micro-batch of the first step").bounds = flag_bounds("batch_size")
    run.add_argument("--accumulation_steps", type=int, default=1,
                     help="micro-batches of the first step").bounds = flag_bounds("accumulation_steps")
    run.add_argument("--dtypes", default="float32", help="the first step's dtype")
    run.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    run.add_argument("--seed", type=int, default=42).bounds = flag_bounds("seed")
    run.add_argument("--keep_tmp", action="store_true", help="keep the synthetic files and caches")
    run.add_argument("--json_out", default=None, help="also write every figure to this JSON file")
    # Internal: the fresh-process measurements.
    parser.add_argument("--probe", choices=("build", "restart"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe_start", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse_options(argv=None) -> argparse.Namespace:
    parser = build_parser()
    options = check_options(parser, parser.parse_args(argv))  # the ranges: checked by parse_args
    try:
        options.sizes = [int(size) for size in options.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error(f"--sizes {options.sizes}: expected numbers of conversations like 10000,100000")
    if not options.sizes or min(options.sizes) < 1:
        parser.error("--sizes needs numbers of conversations >= 1")
    return options


def write_synthetic_data(source: str, count: int, path: Path, seed: int) -> None:
    """`count` conversations drawn (with replacement, fixed seed) from the lines of `source`, each
    varied: every user and assistant message's content gets the row's number (" [row 123]"), so no
    two conversations, questions or replies are the same (the build remembers repeated pieces of
    text: repeated rows would flatter it); tool definitions, calls and results stay as drawn."""
    with open(source, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rng = random.Random(seed + count)
    with open(path, "w", encoding="utf-8") as handle:
        for number in range(count):
            row = rng.choice(rows)
            key = "conversations" if "conversations" in row else "messages"
            messages = [dict(message, content=f"{message.get('content') or ''} [row {number}]")
                        if message.get("role") in ("user", "assistant") else message for message in row[key]]
            handle.write(json.dumps({**row, key: messages}, ensure_ascii=False) + "\n")


def probe_command(options, probe: str, data_path: Path, cache_dir: Path) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--probe", probe, "--probe_start", repr(time.time()),
        "--data_path", str(data_path), "--cache_dir", str(cache_dir), "--device", options.device,
        "--hidden_size", str(options.hidden_size), "--num_hidden_layers", str(options.num_hidden_layers),
        "--max_seq_len", str(options.max_seq_len), "--batch_size", str(options.batch_size),
        "--accumulation_steps", str(options.accumulation_steps), "--dtypes", options.dtypes[0],
        "--seed", str(options.seed),
    ]


def run_probe(options, probe: str, data_path: Path, cache_dir: Path) -> dict:
    """Run a measurement in a fresh interpreter and return its figures."""
    command = probe_command(options, probe, data_path, cache_dir)
    start = time.time()
    completed = subprocess.run(command, capture_output=True, text=True, cwd=str(REPO_DIR))
    if completed.returncode != 0:
        print_escaped(completed.stderr[-2000:].rstrip("\n"), file=sys.stderr)  # its traceback, lines kept
        fail(f"probe {probe} failed with exit status {completed.returncode} (the end of its stderr above)")
    lines = [line for line in completed.stdout.splitlines() if line.startswith(PROBE_PREFIX)]
    figures = json.loads(lines[-1][len(PROBE_PREFIX):])
    figures["process_wall_s"] = time.time() - start  # includes the interpreter's exit
    return figures


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children."""
    used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(usage.ru_utime + usage.ru_stime for usage in used)


def probe_main(options) -> None:
    """In a fresh process: build the cache (`build`) or restart the trainer up to its first step (`restart`)."""
    figures = {"python_and_imports_s": time.time() - options.probe_start}
    start = time.time()
    tokenizer = load_tokenizer(None)
    figures["tokenizer_s"] = time.time() - start
    device = resolve_device(options.device)
    options.device = str(device)
    if options.probe == "build":
        from dataset.cache import default_num_proc

        figures["rss_before_build_mib"] = (proc_status_kib("VmRSS") or 0) / 1024
        cpu_before, start = cpu_seconds(), time.time()
        dataset = build_cache_and_open(options.data_path, tokenizer, options.max_seq_len, cache_dir=options.cache_dir)
        figures["cache_build_s"] = time.time() - start
        figures["cache_build_cpu_s"] = cpu_seconds() - cpu_before
        figures["cache_build_processes"] = default_num_proc()
        figures["samples"] = len(dataset)
        figures["tokens"] = dataset.num_tokens
    else:
        args = trainer_args(options, options.dtypes[0])
        figures.update(first_step_seconds(args, tokenizer, single_process_context(device),
                                          getattr(torch, options.dtypes[0]), options.vocab_size))
        figures["to_first_step_s"] = time.time() - options.probe_start
    figures["rss_mib"] = (proc_status_kib("VmRSS") or 0) / 1024
    figures["peak_rss_mib"] = peak_rss_mib()
    figures["workers_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(PROBE_PREFIX + json.dumps(figures), flush=True)


def format_header() -> str:
    return "  ".join(f"{title:>{max(len(title), 9)}}" for _, title, _ in COLUMNS)


def format_row(row: dict) -> str:
    cells = []
    for key, title, number_format in COLUMNS:
        value = row[key]
        text = ", ".join(f"{seconds:.2f}" for seconds in value) if isinstance(value, list) else format(value, number_format)
        cells.append(f"{text:>{max(len(title), 9)}}")
    return "  ".join(cells)


def measure_size(options, count: int, work_dir: Path) -> dict:
    """The row of one synthetic file of `count` conversations."""
    data_path = work_dir / f"synthetic_{count}.jsonl"
    cache_dir = work_dir / f"cache_{count}"
    write_synthetic_data(options.data_path, count, data_path, options.seed)
    build = run_probe(options, "build", data_path, cache_dir)
    restarts = [run_probe(options, "restart", data_path, cache_dir) for _ in range(options.restarts)]
    cache_bytes = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())
    return {
        "conversations": count,
        "data_mib": data_path.stat().st_size / MIB,
        "samples": build["samples"],
        "tokens": build["tokens"],
        "cache_build_s": build["cache_build_s"],
        "cache_build_rows_per_s": count / build["cache_build_s"],
        "cache_build_processes": build["cache_build_processes"],
        "cache_build_cpu_s": build["cache_build_cpu_s"],
        "cache_build_rows_per_core_s": count / build["cache_build_cpu_s"],
        "cache_build_rss_before_mib": build["rss_before_build_mib"],
        "cache_build_peak_rss_mib": build["peak_rss_mib"],
        "cache_build_workers_peak_rss_mib": build["workers_peak_rss_mib"],
        "cache_mib": cache_bytes / MIB,
        "restart_s": [probe["to_first_step_s"] for probe in restarts],
        "restart_dataset_s": min(probe["dataset_s"] for probe in restarts),
        "restart_breakdown": restarts,
        "restart_peak_rss_mib": max(probe["peak_rss_mib"] for probe in restarts),
    }


def summarize(results: list[dict]) -> str:
    largest, smallest = results[-1], results[0]
    median_restart = sorted(largest["restart_s"])[len(largest["restart_s"]) // 2]

    def growth(key: str) -> str:
        return (f"{smallest[key]:.0f} MiB at {smallest['conversations']} -> {largest[key]:.0f} MiB at "
                f"{largest['conversations']} ({largest[key] - smallest[key]:+.0f} MiB)")

    return (f"summary: restart to first step with {largest['conversations']} conversations: median "
            f"{median_restart:.2f} s (target < 5 s: {'met' if median_restart < 5 else 'NOT met'}); cache build "
            f"{largest['cache_build_rows_per_s']:.0f} rows/s ({largest['cache_build_processes']} processes, "
            f"{largest['cache_build_rows_per_core_s']:.0f} rows/s per core) in {largest['cache_build_s']:.0f} s; "
            f"build peak RSS {growth('cache_build_peak_rss_mib')}, "
            f"its tokenizer workers {growth('cache_build_workers_peak_rss_mib')}; restart peak RSS "
            f"{growth('restart_peak_rss_mib')}")


def run_scaling(options) -> dict:
    device = resolve_device(options.device)
    options.device = str(device)
    print(f"machine: {machine_description(device)}")
    print(f"scaling: synthetic conversations resampled from {options.data_path} (seed {options.seed}); restart = "
          f"fresh process: import + tokenizer + SFTDataset on the existing cache + model build (hidden "
          f"{options.hidden_size}, layers {options.num_hidden_layers}) + first optimizer step (batch "
          f"{options.batch_size}, {options.dtypes[0]})")
    work_dir = Path(tempfile.mkdtemp(prefix="minisft-bench-scaling-"))
    results = []
    try:
        print()
        print(format_header())
        for count in options.sizes:
            results.append(measure_size(options, count, work_dir))
            print(format_row(results[-1]), flush=True)
    finally:
        if options.keep_tmp:
            print(f"kept {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    summary = summarize(results)
    print(summary)
    return {"machine": machine_description(device), "scaling": results, "summary": summary,
            "options": options_record(options)}


def main(argv=None) -> int:
    options = parse_options(argv)
    if options.probe:
        probe_main(options)
        return 0
    write_report(options, run_scaling(options))
    return 0


if __name__ == "__main__":
    run_main(main)
