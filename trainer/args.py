"""Command-line flags of `train_full_sft.py`, grouped by the step of the script that uses them.

Flag names follow MiniMind (`--epochs --batch_size --learning_rate ...`); the names used by
the distributed-training guide in the seed documents are accepted as aliases
(`--gradient_accumulation_steps`, `--total_steps`, `--train_data_path`, ...).
Relative paths are relative to the current directory; the defaults point into this repo.
"""

import argparse
import math
import os
import re

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRAIN_DATA = os.path.join(REPO_DIR, "dataset", "demo", "sft_train.jsonl")
DEFAULT_EVAL_DATA = os.path.join(REPO_DIR, "dataset", "demo", "sft_eval.jsonl")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Full-parameter SFT of a MiniMind model (python, torchrun, multi-node, SLURM).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    dist = parser.add_argument_group("1. distributed")
    dist.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                      help="process-group backend; auto = nccl with CUDA, else gloo")
    dist.add_argument("--dist_timeout", type=float, default=600.0,
                      help="seconds a collective (or a missing peer) may block before the run fails")
    dist.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto/cuda: the one visible GPU, else cuda:LOCAL_RANK)")
    dist.add_argument("--world_size", type=int, default=1,
                      help="start this many local workers yourself (for machines without torchrun)")
    dist.add_argument("--local_rank", "--local-rank", type=int, default=None,
                      help="set by the legacy `python -m torch.distributed.launch`; not for users")

    seed = parser.add_argument_group("2. seed")
    seed.add_argument("--seed", type=int, default=42, help="base seed; each rank uses seed + rank")

    cfg = parser.add_argument_group("3. model config and resume")
    cfg.add_argument("--hidden_size", type=int, default=768, help="model width (MiniMind: 512 or 768)")
    cfg.add_argument("--num_hidden_layers", type=int, default=8, help="transformer blocks")
    cfg.add_argument("--num_attention_heads", type=int, default=8, help="query heads; must divide hidden_size")
    cfg.add_argument("--num_key_value_heads", type=int, default=4, help="key/value heads (GQA); must divide the query heads")
    cfg.add_argument("--use_moe", type=int, choices=(0, 1), default=0, help="1 = top-k routed mixture-of-experts MLPs")
    cfg.add_argument("--num_experts", type=int, default=4, help="experts per MoE layer")
    cfg.add_argument("--num_experts_per_tok", type=int, default=2, help="experts each token is routed to")
    cfg.add_argument("--dropout", type=float, default=0.0, help="dropout on embeddings, attention and MLP outputs")
    cfg.add_argument("--from_resume", type=int, choices=(0, 1), default=0,
                     help="1 = continue from the latest valid resume checkpoint in --save_dir (if any)")
    cfg.add_argument("--resume_from", default=None, help="continue from this resume checkpoint file")

    data = parser.add_argument_group("4. data")
    data.add_argument("--data_path", "--train_data_path", default=DEFAULT_TRAIN_DATA,
                      help="training jsonl (MiniMind, ShareGPT or OpenAI lines); default: the bundled demo set")
    data.add_argument("--eval_data_path", "--valid_data_path", default=None,
                      help="held-out jsonl; its loss is logged every --eval_interval steps and at the end")
    data.add_argument("--tokenizer_path", default=None, help="HF tokenizer dir; default: the shipped model/tokenizer")
    data.add_argument("--max_seq_len", type=int, default=512, help="samples are truncated to this many tokens")
    data.add_argument("--packing", type=int, choices=(0, 1), default=0,
                      help="1 = concatenate samples into rows of max_seq_len (attention kept per document)")
    data.add_argument("--group_by_length", type=int, choices=(0, 1), default=1,
                      help="1 = batch samples of similar length together (batch order stays random); "
                           "0 = plain shuffled batches (more padding)")
    data.add_argument("--bad_data", choices=("error", "skip"), default="error",
                      help="what to do with a malformed data line")
    data.add_argument("--num_workers", type=int, default=None,
                      help="DataLoader workers; default on CUDA: up to 4 per process, from the spare cores; on CPU 0")
    data.add_argument("--cache_dir", default=None, help="where the tokenized cache lives; default next to the data")

    mdl = parser.add_argument_group("5. model weights")
    mdl.add_argument("--from_weight", default="none",
                     help="initial weights: none (from scratch), a safetensors file, or an HF model directory")
    mdl.add_argument("--gradient_checkpointing", type=int, choices=(0, 1), default=0,
                     help="1 = recompute activations in backward (less memory, ~30%% more compute)")
    mdl.add_argument("--use_compile", type=int, choices=(0, 1), default=0,
                     help="1 = torch.compile the model (compiling takes a while first; gain: README, Figures)")

    loop = parser.add_argument_group("6. training loop")
    loop.add_argument("--epochs", type=int, default=1, help="passes over the training data")
    loop.add_argument("--max_steps", "--total_steps", type=int, default=0,
                      help="stop after this many optimizer steps (0 = run all epochs)")
    loop.add_argument("--batch_size", type=int, default=16, help="samples per process per micro-step")
    loop.add_argument("--accumulation_steps", "--gradient_accumulation_steps", type=int, default=1,
                      help="micro-batches per optimizer step (gradients all-reduced once per step)")
    loop.add_argument("--learning_rate", type=float, default=5e-4, help="peak LR of the cosine schedule")
    loop.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine floor as a fraction of the peak LR")
    loop.add_argument("--warmup_steps", type=int, default=None, help="default: 3%% of all steps")
    loop.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (matrices only)")
    loop.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm (0 = off)")
    loop.add_argument("--dtype", choices=DTYPES, default="auto",
                      help="autocast dtype; auto = bfloat16 on GPU, float32 on CPU")
    loop.add_argument("--max_bad_steps", type=int, default=5,
                      help="stop after this many non-finite optimizer steps in a row")
    loop.add_argument("--eval_interval", type=int, default=0,
                      help="evaluate every N optimizer steps (0 = only at the end, if --eval_data_path)")

    save = parser.add_argument_group("7. saving")
    save.add_argument("--save_dir", default="out", help="checkpoints/, model/ and metrics.jsonl go here")
    save.add_argument("--save_interval", type=int, default=100, help="save every N optimizer steps (0 = only at the end)")
    save.add_argument("--save_dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                      help="dtype of the inference weights (resume checkpoints are always fp32)")
    save.add_argument("--keep_last", type=int, default=3, help="resume checkpoints to keep")

    log = parser.add_argument_group("8. logging")
    log.add_argument("--log_interval", type=int, default=10, help="print and record figures every N optimizer steps")
    log.add_argument("--use_wandb", type=int, choices=(0, 1), default=0,
                     help="1 = also log to wandb (WANDB_MODE=offline works; a resumed run continues its wandb run)")
    log.add_argument("--wandb_project", default="minisft", help="wandb project")
    log.add_argument("--wandb_run_name", default=None, help="wandb run name")
    return parser


# The range of every numeric flag, checked at start: (flag, lowest, highest, lowest allowed itself).
# None = unbounded on that side. Non-finite values (inf, nan) are refused for every float flag.
# Add a row here with every new numeric flag.
RANGES = (
    ("dist_timeout", 0, None, False),
    ("world_size", 1, None, True),
    ("local_rank", 0, None, True),
    ("seed", 0, 2**32 - 1, True),
    ("hidden_size", 1, None, True),
    ("num_hidden_layers", 1, None, True),
    ("num_attention_heads", 1, None, True),
    ("num_key_value_heads", 1, None, True),
    ("num_experts", 1, None, True),
    ("num_experts_per_tok", 1, None, True),
    ("dropout", 0, 1, True),
    ("max_seq_len", 2, None, True),
    ("num_workers", 0, None, True),
    ("epochs", 1, None, True),
    ("max_steps", 0, None, True),
    ("batch_size", 1, None, True),
    ("accumulation_steps", 1, None, True),
    ("learning_rate", 0, None, False),
    ("min_lr_ratio", 0, 1, True),
    ("warmup_steps", 0, None, True),
    ("weight_decay", 0, None, True),
    ("grad_clip", 0, None, True),
    ("max_bad_steps", 1, None, True),
    ("eval_interval", 0, None, True),
    ("save_interval", 0, None, True),
    ("keep_last", 1, None, True),
    ("log_interval", 1, None, True),
)
DEVICE_HELP = "use auto, cpu, cuda or cuda:N"


def range_problems(args: argparse.Namespace) -> list[str]:
    """One message per numeric flag outside its range (flags absent from `args` are skipped)."""
    problems = []
    for name, low, high, low_allowed in RANGES:
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"--{name} must be a finite number (got {value})")
        elif low is not None and (value < low or (value == low and not low_allowed)):
            problems.append(f"--{name} must be {'>=' if low_allowed else '>'} {low} (got {value})")
        elif high is not None and value > high:
            problems.append(f"--{name} must be <= {high} (got {value})")
    return problems


def device_problem(device: str) -> str | None:
    """`--device` must name a device this trainer runs on; mps, xla, gpu, ... are refused here."""
    if device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device):
        return None
    if device in ("gpu", "gpu:0") or re.fullmatch(r"gpu:\d+", device):
        return f"--device {device}: unknown device; for an NVIDIA GPU use cuda or cuda:N"
    return f"--device {device}: not supported ({DEVICE_HELP})"


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = range_problems(args)
    if device_problem(args.device):
        problems.append(device_problem(args.device))
    if args.from_resume and args.resume_from:
        problems.append("use either --from_resume 1 or --resume_from PATH, not both")
    if problems:
        parser.error("; ".join(problems))
    for name in ("data_path", "eval_data_path", "tokenizer_path", "save_dir", "resume_from", "cache_dir"):
        value = getattr(args, name)
        if value:
            setattr(args, name, os.path.abspath(value))
    if args.from_weight not in ("none", ""):
        args.from_weight = os.path.abspath(args.from_weight)
    return args
