"""Training-throughput benchmark: MiniMind's pad-to-max scheme against the trainer's padding modes.

    python scripts/bench.py --hidden_size 256 --num_hidden_layers 4 --max_seq_len 512 --batch_size 8
    python scripts/bench.py --scaling        # cache build, restart time and RSS for 10k and 100k chats
    python scripts/bench.py --scaling --scaling_sizes 100000,1000000 --restarts 1
    python scripts/bench.py --prep --max_seq_len 1024   # data preparation per core against MiniMind's

Modes, all measured in this one process (compare ratios within one run, never figures of
different runs). Every (mode, dtype) gets its own model built from the same seed, the same data
file and the same sampler seed:

  minimind  every sample padded to --max_seq_len (SFTCollator pad_to_length), full [B, T, V]
            logits, loss = mean over the micro-batch's loss tokens / accumulation_steps
            (skip_logits=False, no num_items_in_batch): MiniMind's scheme. MiniMind also
            all-reduces gradients on every micro-step; in one process that costs nothing.
  dynamic   the trainer's path: pad to the longest sample of the batch, LM head only at the
            loss positions (skip_logits), loss = sum / loss tokens of the optimizer step.
  grouped   dynamic + the length-grouped sampler (the trainer's --group_by_length 1).
  packed    PackedSFTDataset rows of up to --max_seq_len tokens with position_ids (--packing 1).
  unchunked dynamic, but the LM head + cross-entropy over all loss positions at once (not in
            chunks): with --vocab_size 151936 (Qwen3's vocabulary) its peak/step MiB against
            the dynamic mode's is the memory the chunked loss saves. Not run by default.

Each mode runs the trainer's own code: the loader of trainer/data_setup.build_train_data (the
minimind mode swaps in a pad-to-max collator), trainer/loop.agree_on_step and
trainer/loop.optimizer_step (the minimind mode wraps the model so that the same optimizer_step
computes MiniMind's loss). bfloat16 is the trainer's autocast (CPU autocast on CPU).

Work per mode: --warmup_steps optimizer steps (not timed), then exactly --steps timed optimizer
steps of --accumulation_steps micro-batches of --batch_size rows each. A fixed number of steps is
a fixed number of ROWS; a packed row holds several samples, so packing consumes more samples
per step. The fair comparison is loss tokens/s (the "x minimind" column). The timed steps are
interleaved: --rounds rounds, each running a chunk of every mode's steps in turn, so that a
change of the machine's background load affects all modes alike (default: one step per chunk).

--use_compile 1 compiles every mode's model (the trainer's --use_compile 1); --use_compile both
runs every mode twice, eager and compiled, side by side ("compiled" column; the summary gives
compiled/eager loss tok/s and the warm-up seconds, which hold the compilation). A compiled
mode warms up longer: until 5 steps in a row compiled nothing new (torch.compile specializes on
a few ranges of batch length), so that no compilation lands in the timed steps. Inductor keeps
compiled kernels in an on-disk cache (TORCHINDUCTOR_CACHE_DIR), so a second run warms up faster.

Columns:
  steps/s         timed optimizer steps / timed wall time (data loading and collation included)
  samples/s       conversations consumed per second (a packed row counts its samples)
  comp tok/s      all positions of the batches, pads included (sum of B x T)
  real tok/s      non-pad tokens
  loss tok/s      tokens that carry a label after the shift
  pad             padded positions / all positions
  GFLOP/loss tok  model FLOPs of the timed steps / their loss tokens (formula below)
  x minimind      loss tok/s / loss tok/s of the minimind mode of the same dtype
  MFU             model FLOPs/s / peak FLOPs/s; the peak is measured in this run: the best of
                  a few --matmul_size square matmuls in the run's dtype on the run's device
  peak MiB        peak during one untimed optimizer step of the mode, run after its warm-up
                  (after the modes before it were built): CUDA: torch.cuda.max_memory_allocated;
                  CPU: peak RSS (VmHWM, reset via /proc/self/clear_refs after a gc and
                  malloc_trim; where that is not possible, ru_maxrss, which never decreases)
  step MiB        that peak minus the memory in use just before the step: what one step adds
                  (activations, logits, gradients); the column to compare between modes

Model FLOPs of one micro-batch (forward + backward = 3 x forward; a multiply-add is 2 FLOPs):

  6 * N_body * computed_tokens                       N_body: all parameters except the embedding
                                                     table (a lookup) and the LM head
  + 6 * hidden_size * vocab_size * logit_positions   LM head: every position (minimind) or only
                                                     the loss positions (skip_logits)
  + 12 * layers * heads * head_dim * causal_pairs    attention scores and weighted sum;
                                                     causal_pairs = T(T+1)/2 per row of length T,
                                                     or per document of length T of a packed row

Pads count as computed work (the kernels compute them). A packed row's attention runs per
document (model/packed_attention.py), so its pairs are counted per document.

Startup (in this process, `import torch` excluded): tokenizer load, SFTDataset from a fresh
cache directory (tokenizes the file) and from the existing cache, model + optimizer build, and
the first optimizer step of the dynamic mode. `--scaling` measures the cache build and real
restarts in fresh processes: for synthetic files of --scaling_sizes conversations (demo lines
resampled with a fixed seed, so lengths follow the demo data, each user and assistant message
given the row's number so that no text repeats; e.g. `--scaling_sizes 100000,1000000`) it
reports the cache build (sha256 of the file, row count, tokenizing with the default number of
processes: every core) in seconds, rows/s and rows/s per core (rows / CPU seconds of the building
process and its workers), the peak RSS of the building process
(VmHWM; torch and the tokenizer included) and of its largest tokenizer worker (ru_maxrss of the
children), both meant to stay flat in the file size; then the time from process start to the
end of the first optimizer step with the cache present (tokenizer, dataset, model, first step;
target < 5 s for 100k) and that process's peak RSS (flat too: the tokens stay memory-mapped).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import io
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset import SFTCollator, SFTDataset, load_tokenizer  # noqa: E402
from model.packed_attention import document_starts  # noqa: E402
from scripts._common import REPO_DIR, ArgumentParser, fail, resolve_device  # noqa: E402
from trainer.args import parse_args  # noqa: E402
from trainer.data_setup import build_train_data  # noqa: E402
from trainer.runtime.distributed import DistContext  # noqa: E402
from dataset import IGNORE_INDEX  # noqa: E402
from trainer.loop.loop import agree_on_step, optimizer_step  # noqa: E402
from trainer.loop.state import Run  # noqa: E402
from trainer.model_setup import build_model, build_model_config, build_optimizer, compile_model  # noqa: E402
from trainer.runtime.precision import build_grad_scaler  # noqa: E402
from trainer.parallel.ddp import Replicated  # noqa: E402
from trainer.runtime.preemption import PreemptionFlag  # noqa: E402
from trainer.runtime.seeding import setup_seed  # noqa: E402

MODES = ("minimind", "dynamic", "grouped", "packed", "unchunked")
DEFAULT_MODES = MODES[:4]
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_DATA = REPO_DIR / "dataset" / "demo" / "sft_train.jsonl"
PROBE_PREFIX = "PROBE "
MIB = 1024 * 1024

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
    ("peak_memory_mib", "peak MiB", ".0f"),
    ("step_memory_mib", "step MiB", ".0f"),
    ("speedup_vs_minimind", "x minimind", ".2f"),
]
TEXT_WIDTH = 9


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Throughput of MiniMind's pad-to-max SFT against the trainer's dynamic, grouped and packed "
                    "modes (fp32 / bf16), model FLOPs and MFU, memory, startup; --scaling for restart time and RSS.",
        epilog="See the module docstring (top of scripts/bench.py) for the exact definitions and the FLOP formula.",
    )
    model = parser.add_argument_group("model and data")
    model.add_argument("--hidden_size", type=int, default=256)
    model.add_argument("--num_hidden_layers", type=int, default=4)
    model.add_argument("--max_seq_len", type=int, default=512)
    model.add_argument("--vocab_size", type=int, default=None,
                       help="LM head size (default: the tokenizer's); e.g. 151936 for a Qwen3-sized head on the same data")
    model.add_argument("--data_path", default=str(DEFAULT_DATA), help="SFT jsonl file")
    model.add_argument("--cache_dir", default=None, help="token cache of the timed modes; default: next to the data")
    run = parser.add_argument_group("run")
    run.add_argument("--batch_size", type=int, default=8, help="rows per micro-batch")
    run.add_argument("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    run.add_argument("--steps", type=int, default=10, help="timed optimizer steps per mode")
    run.add_argument("--warmup_steps", type=int, default=2, help="untimed optimizer steps per mode before timing")
    run.add_argument("--rounds", type=int, default=0,
                     help="the timed steps of every mode are cut into this many chunks, run in turn "
                          "(A, B, ..., A, B, ...); 0 = one step per chunk")
    run.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(MODES)}")
    run.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16 (GPU)")
    run.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    run.add_argument("--use_compile", choices=("0", "1", "both"), default="0",
                     help="1 = torch.compile the model (the trainer's --use_compile 1); both = every mode eager "
                          "and compiled, side by side")
    run.add_argument("--seed", type=int, default=42)
    run.add_argument("--matmul_size", type=int, default=2048, help="side of the square matmul that measures the peak")
    run.add_argument("--json_out", default=None, help="also write every figure to this JSON file")
    scaling = parser.add_argument_group("scaling (--scaling)")
    scaling.add_argument("--scaling", action="store_true",
                         help="instead of the modes: cache build (s, rows/s, peak RSS) and restart to the first step "
                         "(s, peak RSS) for synthetic data sets")
    scaling.add_argument("--scaling_sizes", default="10000,100000", help="numbers of synthetic conversations")
    scaling.add_argument("--restarts", type=int, default=3, help="restart measurements per size")
    scaling.add_argument("--keep_tmp", action="store_true", help="keep the synthetic files and caches")
    prep = parser.add_argument_group("data preparation (--prep)")
    prep.add_argument("--prep", action="store_true",
                      help="instead of the modes: rows/s per core of our data preparation (parse, template, loss spans, "
                      "tokenize) against MiniMind's per-sample preprocessing, on plain and on tool/reasoning rows "
                      "(scripts/bench_prep.py)")
    prep.add_argument("--step_compare", action="store_true",
                      help="instead of the modes: the trainer's CPU optimizer step as before this wave, as this wave "
                      "started and as now, one step of each in turn (scripts/bench_step.py)")
    prep.add_argument("--prep_rows", type=int, default=0,
                      help="rows of each data set (plain, tool), each row once; 0 = all of the file's")
    # Internal: the fresh-process measurements of --scaling.
    parser.add_argument("--probe", choices=("build", "restart"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe_start", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse_options(argv=None) -> argparse.Namespace:
    parser = build_parser()
    options = parser.parse_args(argv)
    options.modes = [mode.strip() for mode in options.modes.split(",") if mode.strip()]
    options.dtypes = [name.strip() for name in options.dtypes.split(",") if name.strip()]
    unknown = [mode for mode in options.modes if mode not in MODES] + [d for d in options.dtypes if d not in DTYPE_NAMES]
    if unknown:
        parser.error(f"unknown mode or dtype: {', '.join(unknown)}")
    if not options.modes or not options.dtypes:
        parser.error("--modes and --dtypes need at least one entry")
    for name in ("hidden_size", "num_hidden_layers", "max_seq_len", "batch_size", "accumulation_steps", "steps",
                 "restarts", "matmul_size"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if options.warmup_steps < 0 or options.rounds < 0:
        parser.error("--warmup_steps and --rounds must be >= 0")
    options.rounds = options.rounds or options.steps
    options.scaling_sizes = [int(size) for size in options.scaling_sizes.split(",") if size.strip()]
    options.data_path = str(Path(options.data_path).resolve())
    if not Path(options.data_path).is_file():
        fail(f"{options.data_path}: data file not found")
    return options


# --------------------------------------------------------------------------- measuring


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory() -> None:
    """Free what the previous mode left: Python garbage, the CUDA cache, glibc's free lists."""
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


def reset_peak_memory(device) -> bool:
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


def memory_in_use_mib(device) -> float:
    """CUDA: memory_allocated; CPU: current RSS (VmRSS, else 0)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MIB
    return (proc_status_kib("VmRSS") or 0) / 1024


def peak_memory_mib(device) -> float:
    """CUDA: max_memory_allocated; CPU: peak RSS (VmHWM, else ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    high_water = proc_status_kib("VmHWM")
    if high_water is None:
        high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return high_water / 1024


def measure_peak_flops(device, dtype, size: int, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` [size x size] @ [size x size] matmuls in `dtype` on `device`."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    right = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    torch.matmul(left, right)  # warm-up (kernel selection, allocation)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(left, right)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def machine_description(device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    model_name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
            model_name = names[0] if names else model_name
    return f"{model_name}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


# --------------------------------------------------------------------------- the trainer's pieces


def trainer_args(options, mode: str = "dynamic", dtype_name: str = "float32", cache_dir=None,
                 compiled: bool = False) -> argparse.Namespace:
    """The trainer's own flags (trainer/args.py) for this benchmark mode."""
    argv = [
        "--hidden_size", str(options.hidden_size), "--num_hidden_layers", str(options.num_hidden_layers),
        "--max_seq_len", str(options.max_seq_len), "--batch_size", str(options.batch_size),
        "--accumulation_steps", str(options.accumulation_steps), "--data_path", options.data_path,
        "--packing", str(int(mode == "packed")), "--group_by_length", str(int(mode == "grouped")),
        "--dtype", dtype_name, "--seed", str(options.seed), "--use_compile", str(int(compiled)),
        "--device", str(options.device),
    ]
    cache_dir = cache_dir or options.cache_dir
    if cache_dir:
        argv += ["--cache_dir", str(cache_dir)]
    args = parse_args(argv)
    args.bench_vocab_size = options.vocab_size  # read by build_run only
    return args


class MiniMindObjective(torch.nn.Module):
    """MiniMind's loss on top of the model: full [B, T, V] logits, mean per micro-batch / accumulation.

    Plugged into trainer/loop.optimizer_step as `run.model`, which passes the trainer's
    `num_items_in_batch` and `skip_logits=True`; both are ignored here. `module` is the wrapped
    model, so the trainer's `unwrap` (gradient clipping) finds the real parameters.
    """

    def __init__(self, module: torch.nn.Module, accumulation_steps: int):
        super().__init__()
        self.module = module
        self.accumulation_steps = accumulation_steps

    def forward(self, num_items_in_batch=None, skip_logits=True, **inputs):
        out = self.module(**inputs, skip_logits=False)
        out.loss = out.loss / self.accumulation_steps
        return out


def single_process_context(device) -> DistContext:
    return DistContext(rank=0, local_rank=0, world_size=1, device=device, backend=None)


def build_run(args, tokenizer, ctx, data, dtype, mode: str):
    """The trainer's Run for one mode: model from the seed, AdamW, grad scaler, optional compile."""
    setup_seed(args.seed)
    config = build_model_config(args, tokenizer)
    if args.bench_vocab_size:  # a bigger LM head; the data's token ids stay below the tokenizer's size
        config.vocab_size = args.bench_vocab_size
    model = build_model(args, config, ctx.device)
    model.chunk_lm_loss = mode != "unchunked"
    parallel = Replicated(ctx)
    parallel.wrap(model)
    optimizer = build_optimizer(model, args, ctx.device)
    wrapped = MiniMindObjective(model, args.accumulation_steps) if mode == "minimind" else model
    if args.use_compile:
        wrapped = compile_model(wrapped, ctx.device)
    run = Run(args, ctx, wrapped, optimizer, build_grad_scaler(ctx.device, dtype), dtype, data,
              eval_sets=[], tokenizer=tokenizer, logger=None, preemption=PreemptionFlag(), parallel=parallel)
    run.model.train()
    return run


def build_data(args, tokenizer, ctx, mode: str):
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


def endless_batches(data):
    """Micro-batches of the trainer's loader, epoch after epoch."""
    epoch = 0
    while True:
        data.sampler.set_epoch(epoch)
        yield from data.loader
        epoch += 1


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


def causal_pairs(batch: dict) -> int:
    """(query, key) pairs a causal kernel computes: per row, or per document of a packed row."""
    rows, length = batch["input_ids"].shape
    if "position_ids" not in batch:
        return rows * length * (length + 1) // 2
    _, lengths = document_starts(batch["position_ids"])
    return int((lengths * (lengths + 1) // 2).sum())


def model_flops(model, counts: Counts) -> float:
    """FLOPs of the counted work (formula in the module docstring)."""
    config = model.config
    embedding_and_head = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    body = sum(p.numel() for p in model.parameters() if id(p) not in embedding_and_head)
    attention_width = config.num_attention_heads * config.head_dim
    return (6 * body * counts.computed_tokens
            + 6 * config.hidden_size * config.vocab_size * counts.logit_positions
            + 12 * config.num_hidden_layers * attention_width * counts.causal_pairs)


def optimizer_step_once(run, batches, args) -> list[dict]:
    """One optimizer step of the trainer (constant learning rate); returns its micro-batches."""
    micro_batches = [next(batches) for _ in range(args.accumulation_steps)]
    optimizer_step(run, micro_batches, agree_on_step(run, micro_batches), args.learning_rate)
    return micro_batches


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
    warmup_steps: int = 0
    warmup_seconds: float = 0.0  # includes torch.compile's compilation when compiled
    peak_memory_mib: float = 0.0
    step_memory_mib: float = 0.0  # peak above the memory in use before its memory step


def prepare_mode(options, tokenizer, ctx, mode: str, dtype_name: str, compiled: bool) -> ModeRun:
    """Build the mode's loader, model and optimizer (seeded), run its warm-up steps, then one
    untimed step that measures its peak memory (before the other modes' steps have run)."""
    args = trainer_args(options, mode, dtype_name, compiled=compiled)
    with contextlib.redirect_stdout(io.StringIO()):  # the dataset's notes, already printed by the startup
        data = build_data(args, tokenizer, ctx, mode)
    run = build_run(args, tokenizer, ctx, data, getattr(torch, dtype_name), mode)
    mode_run = ModeRun(mode, dtype_name, compiled, args, run, endless_batches(data))
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
    mode_run.batches = endless_batches(data)
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
    """Time `steps` optimizer steps of one mode and add them to its totals."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        for batch in optimizer_step_once(mode_run.run, mode_run.batches, mode_run.args):
            mode_run.counts.add(batch, full_logits=mode_run.mode == "minimind")
    synchronize(device)
    mode_run.seconds += time.perf_counter() - start
    mode_run.steps += steps


def split_steps(steps: int, rounds: int) -> list[int]:
    """`steps` cut into `rounds` nearly equal chunks (fewer rounds if there are fewer steps)."""
    rounds = min(rounds, steps)
    base, extra = divmod(steps, rounds)
    return [base + (index < extra) for index in range(rounds)]


def mode_result(mode_run: ModeRun, peak_flops: float) -> dict:
    counts, elapsed = mode_run.counts, mode_run.seconds
    flops = model_flops(mode_run.run.raw_model, counts)
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
        "mfu": flops / elapsed / peak_flops,
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
        SFTDataset(options.data_path, tokenizer, options.max_seq_len, cache_dir=fresh_cache)
        figures["dataset_fresh_cache_s"] = time.perf_counter() - start
        args = trainer_args(options, "dynamic", dtype_name, cache_dir=fresh_cache)
        start = time.perf_counter()
        data = build_train_data(args, tokenizer, ctx)  # the cache now exists
        figures["dataset_existing_cache_s"] = time.perf_counter() - start
        start = time.perf_counter()
        run = build_run(args, tokenizer, ctx, data, getattr(torch, dtype_name), "dynamic")
        synchronize(ctx.device)
        figures["model_build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        optimizer_step_once(run, endless_batches(data), args)
        synchronize(ctx.device)
        figures["first_step_s"] = time.perf_counter() - start
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

    startup = measure_startup(options, ctx, options.dtypes[0])
    print("startup (in-process, import torch excluded): tokenizer {tokenizer_s:.2f} s, dataset fresh cache "
          "{dataset_fresh_cache_s:.2f} s / existing cache {dataset_existing_cache_s:.3f} s, model+optimizer "
          "{model_build_s:.2f} s, first step {first_step_s:.2f} s -> to first step: fresh cache "
          "{to_first_step_fresh_cache_s:.2f} s, existing cache {to_first_step_existing_cache_s:.2f} s".format(**startup))

    peak_flops = {name: measure_peak_flops(device, getattr(torch, name), options.matmul_size) for name in options.dtypes}
    print("peak (best {0}x{0} matmul): ".format(options.matmul_size)
          + ", ".join(f"{name} {flops / 1e9:.1f} GFLOP/s" for name, flops in peak_flops.items()))

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
    rows = [mode_result(mode_run, peak_flops[mode_run.dtype_name]) for mode_run in mode_runs]
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
        "options": {key: value for key, value in vars(options).items() if not key.startswith("probe")},
        "flop_formula": "6*N_body*computed_tokens + 6*hidden*vocab*logit_positions + 12*layers*heads*head_dim*causal_pairs",
        "peak_flops": peak_flops,
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


# --------------------------------------------------------------------------- --scaling


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
        fail(f"probe {probe} failed:\n{completed.stderr[-2000:]}")
    lines = [line for line in completed.stdout.splitlines() if line.startswith(PROBE_PREFIX)]
    figures = json.loads(lines[-1][len(PROBE_PREFIX):])
    figures["process_wall_s"] = time.time() - start  # includes the interpreter's exit
    return figures


def token_cache_processes() -> int:
    """Tokenizer processes a build of this process uses (dataset.cache.default_num_proc)."""
    from dataset.cache import default_num_proc

    return default_num_proc()


def probe_main(options) -> None:
    """In a fresh process: build the cache (`build`) or restart the trainer up to its first step (`restart`)."""
    figures = {"python_and_imports_s": time.time() - options.probe_start}
    start = time.time()
    tokenizer = load_tokenizer(None)
    figures["tokenizer_s"] = time.time() - start
    device = resolve_device(options.device)
    options.device = str(device)
    if options.probe == "build":
        figures["rss_before_build_mib"] = (proc_status_kib("VmRSS") or 0) / 1024
        used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        figures["cpu_before_s"] = sum(usage.ru_utime + usage.ru_stime for usage in used)
        start = time.time()
        dataset = SFTDataset(options.data_path, tokenizer, options.max_seq_len, cache_dir=options.cache_dir)
        figures["cache_build_s"] = time.time() - start
        used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        figures["cache_build_cpu_s"] = sum(usage.ru_utime + usage.ru_stime for usage in used) - figures.pop("cpu_before_s")
        figures["cache_build_processes"] = token_cache_processes()
        figures["samples"] = len(dataset)
        figures["tokens"] = dataset.num_tokens
    else:
        ctx = single_process_context(device)
        args = trainer_args(options, "dynamic", options.dtypes[0])
        start = time.time()
        data = build_train_data(args, tokenizer, ctx)
        figures["dataset_s"] = time.time() - start
        figures["samples"] = len(data.dataset)
        start = time.time()
        run = build_run(args, tokenizer, ctx, data, getattr(torch, options.dtypes[0]), "dynamic")
        synchronize(device)
        figures["model_build_s"] = time.time() - start
        start = time.time()
        optimizer_step_once(run, endless_batches(data), args)
        synchronize(device)
        figures["first_step_s"] = time.time() - start
        figures["to_first_step_s"] = time.time() - options.probe_start
    figures["rss_mib"] = (proc_status_kib("VmRSS") or 0) / 1024
    figures["peak_rss_mib"] = (proc_status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024
    figures["workers_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(PROBE_PREFIX + json.dumps(figures), flush=True)


SCALING_COLUMNS = [  # (JSON key, header, format)
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


def format_scaling_header() -> str:
    return "  ".join(f"{title:>{max(len(title), 9)}}" for _, title, _ in SCALING_COLUMNS)


def format_scaling_row(row: dict) -> str:
    cells = []
    for key, title, number_format in SCALING_COLUMNS:
        value = row[key]
        text = ", ".join(f"{seconds:.2f}" for seconds in value) if isinstance(value, list) else format(value, number_format)
        cells.append(f"{text:>{max(len(title), 9)}}")
    return "  ".join(cells)


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
        print(format_scaling_header())
        for count in options.scaling_sizes:
            data_path = work_dir / f"synthetic_{count}.jsonl"
            cache_dir = work_dir / f"cache_{count}"
            write_synthetic_data(options.data_path, count, data_path, options.seed)
            build = run_probe(options, "build", data_path, cache_dir)
            restarts = [run_probe(options, "restart", data_path, cache_dir) for _ in range(options.restarts)]
            cache_bytes = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())
            row = {
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
            results.append(row)
            print(format_scaling_row(row), flush=True)
    finally:
        if options.keep_tmp:
            print(f"kept {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    largest, smallest = results[-1], results[0]
    median_restart = sorted(largest["restart_s"])[len(largest["restart_s"]) // 2]

    def growth(key: str) -> str:
        return (f"{smallest[key]:.0f} MiB at {smallest['conversations']} -> {largest[key]:.0f} MiB at "
                f"{largest['conversations']} ({largest[key] - smallest[key]:+.0f} MiB)")

    summary = (f"summary: restart to first step with {largest['conversations']} conversations: median "
               f"{median_restart:.2f} s (target < 5 s: {'met' if median_restart < 5 else 'NOT met'}); cache build "
               f"{largest['cache_build_rows_per_s']:.0f} rows/s ({largest['cache_build_processes']} processes, "
               f"{largest['cache_build_rows_per_core_s']:.0f} rows/s per core) in {largest['cache_build_s']:.0f} s; "
               f"build peak RSS {growth('cache_build_peak_rss_mib')}, "
               f"its tokenizer workers {growth('cache_build_workers_peak_rss_mib')}; restart peak RSS "
               f"{growth('restart_peak_rss_mib')}")
    print(summary)
    return {"machine": machine_description(device), "scaling": results, "summary": summary,
            "options": {key: value for key, value in vars(options).items() if not key.startswith("probe")}}


def main(argv=None) -> int:
    options = parse_options(argv)
    if options.probe:
        probe_main(options)
        return 0
    if options.prep:
        from scripts.bench_prep import run_prep

        report = run_prep(options, load_tokenizer(None), machine_description(torch.device("cpu")))
    elif options.step_compare:
        from scripts.bench_step import run_step_compare

        helpers = (trainer_args, build_data, build_run, endless_batches, optimizer_step_once, single_process_context)
        report = run_step_compare(options, load_tokenizer(None), machine_description(torch.device("cpu")), helpers)
    else:
        report = run_scaling(options) if options.scaling else run_modes(options)
    if options.json_out:
        Path(options.json_out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
