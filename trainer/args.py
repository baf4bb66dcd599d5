"""Command-line flags of `train_full_sft.py`, grouped by the step of the script that uses them.

Flag names follow MiniMind (`--epochs --batch_size --learning_rate ...`); the names used by
the distributed-training guide in the seed documents are accepted as aliases
(`--gradient_accumulation_steps`, `--total_steps`, `--train_data_path`, ...).
Relative paths are relative to the current directory; the defaults point into this repo.
"""

import argparse
import copy
import math
import os
import re

from dataset.mixture import absolute_data_path, split_weight
from trainer.evaluation.selection import flag_problems as selection_problems
from trainer.runtime.precision import TF32_CHOICES

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
    dist.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto/cuda: cuda:LOCAL_RANK, or a task's own GPU under srun --gpus-per-task)")
    dist.add_argument("--world_size", type=int, default=1,
                      help="start this many local workers yourself (for machines without torchrun)")
    dist.add_argument("--fsdp", type=int, choices=(0, 1), default=0,
                      help="1 = shard weights, gradients and optimizer state over the processes (FSDP2) instead of DDP")
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
    cfg.add_argument("--num_experts_per_tok", type=int, default=1, help="experts each token is routed to")
    cfg.add_argument("--rms_norm_eps", type=float, default=1e-6, help="epsilon of every RMSNorm (MiniMind and Qwen3: 1e-6)")
    cfg.add_argument("--aux_loss_coef", type=float, default=5e-4,
                     help="MoE load-balancing loss coefficient (the config's router_aux_loss_coef)")
    cfg.add_argument("--dropout", type=float, default=0.0, help="dropout on embeddings, attention and MLP outputs")
    cfg.add_argument("--from_resume", type=int, choices=(0, 1), default=0,
                     help="1 = continue from the latest valid resume checkpoint in --save_dir (if any)")
    cfg.add_argument("--resume_from", default=None, help="continue from this resume checkpoint file")

    data = parser.add_argument_group("4. data")
    data.add_argument("--data_path", "--train_data_path", default=DEFAULT_TRAIN_DATA,
                      help="training data: a .jsonl, .jsonl.gz or .parquet file (MiniMind, ShareGPT or OpenAI rows), "
                           "a directory of such shards or a quoted glob; several sources comma-separated, each with "
                           "an optional :WEIGHT (how often it is drawn per epoch relative to the others, default 1), "
                           "e.g. general.jsonl:3,tools.parquet:1,shards/ (docs/data.md); default: the bundled demo set")
    data.add_argument("--eval_data_path", "--valid_data_path", default=None,
                      help="held-out jsonl file(s), comma-separated (each reported on its own); evaluated every "
                           "--eval_interval steps and at the end")
    data.add_argument("--tokenizer_path", default=None,
                      help="HF tokenizer dir; default: the tokenizer of --from_weight (saved with it, or recorded by "
                           "its resume checkpoint's run), else the shipped model/tokenizer. One that differs from the "
                           "weights' own (vocabulary, special tokens or chat template) is refused")
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
    data.add_argument("--system_prompt_ratio", type=float, default=0.0,
                      help="augmentation: this fraction of the samples without a system prompt get a random one, "
                           "drawn per (seed, epoch, sample) (MiniMind: 0.2)")
    data.add_argument("--drop_empty_think_ratio", type=float, default=0.0,
                      help="augmentation: in this fraction of the samples the empty <think> blocks are removed, "
                           "drawn per (seed, epoch, sample) (MiniMind: 0.8)")

    mdl = parser.add_argument_group("5. model weights")
    mdl.add_argument("--from_weight", default="none",
                     help="initial weights: none (from scratch); a MiniMind .pth state dict; a MiniMind name such as "
                          "pretrain (= SAVE_DIR/pretrain_HIDDEN[_moe].pth); an HF directory of this model or of "
                          "Qwen3 / Qwen3-MoE (sharded too); a .safetensors file; a resume checkpoint (its recorded "
                          "tokenizer comes with it). The architecture comes from the weights (docs/weights.md). With "
                          "--from_resume 1 / --resume_from and a checkpoint to continue, the checkpoint's weights win: "
                          "these are not loaded (their architecture must still match), and the log says so")
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
    loop.add_argument("--tf32", choices=TF32_CHOICES, default="auto",
                      help="TF32 tensor cores for the float32 matmuls of a CUDA run: auto = with --dtype bfloat16 or "
                           "float16 only (--dtype float32 computes in IEEE float32), 1 = always, 0 = never")
    loop.add_argument("--max_bad_steps", type=int, default=5,
                      help="stop after this many non-finite optimizer steps in a row")

    evl = parser.add_argument_group("6b. evaluation (needs --eval_data_path)")
    evl.add_argument("--eval_interval", type=int, default=0,
                     help="evaluate every N optimizer steps (0 = only at the end): loss and token accuracy on "
                          "every held-out file")
    evl.add_argument("--eval_generate_samples", type=int, default=0,
                     help="also answer the first N conversations of each held-out file greedily and report "
                          "eval_exact_match and, where the answers call tools, eval_tool_call_accuracy (0 = off; "
                          "ranks share the work)")
    evl.add_argument("--eval_max_new_tokens", type=int, default=64, help="most tokens generated per answer")
    evl.add_argument("--keep_best", default=None, metavar="METRIC",
                     help="keep the model of the best evaluation in SAVE_DIR/best/ (with best.json): eval_loss "
                          "(lower is better), eval_token_accuracy, eval_exact_match, eval_tool_call_accuracy "
                          "(higher), or a per-file key such as eval_loss/NAME")
    evl.add_argument("--early_stop_patience", type=int, default=0,
                     help="stop (and save) after N evaluations without improvement of --keep_best (0 = off)")

    save = parser.add_argument_group("7. saving")
    save.add_argument("--save_dir", default="out", help="checkpoints/, model/ and metrics.jsonl go here")
    save.add_argument("--save_interval", type=int, default=100, help="save every N optimizer steps (0 = only at the end)")
    save.add_argument("--save_dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                      help="dtype of the inference weights (resume checkpoints are always fp32)")
    save.add_argument("--keep_last", type=int, default=3, help="resume checkpoints to keep")
    save.add_argument("--overwrite", type=int, choices=(0, 1), default=0,
                      help="1 = start a new run in a --save_dir that holds another run (its files are moved "
                           "to <save_dir>/set_aside/, not deleted)")
    save.add_argument("--save_weight", default=None,
                      help="MiniMind's prefix: also write SAVE_DIR/PREFIX_HIDDEN[_moe].pth (fp16, MiniMind's state dict, "
                           "for its eval_llm.py) at every save, e.g. --save_weight full_sft")

    log = parser.add_argument_group("8. logging")
    log.add_argument("--log_interval", type=int, default=10, help="print and record figures every N optimizer steps")
    log.add_argument("--use_wandb", type=int, choices=(0, 1), default=0, nargs="?", const=1,
                     help="1 (or bare --use_wandb) = also log to wandb (WANDB_MODE=offline works; a resumed run continues "
                          "its wandb run; charts plot against the train/step metric, so steps logged again after a "
                          "resume are kept)")
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
    ("aux_loss_coef", 0, None, True),
    ("rms_norm_eps", 0, None, False),
    ("max_seq_len", 2, None, True),
    ("system_prompt_ratio", 0, 1, True),
    ("drop_empty_think_ratio", 0, 1, True),
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
    ("eval_generate_samples", 0, None, True),
    ("eval_max_new_tokens", 1, None, True),
    ("early_stop_patience", 0, None, True),
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


def explicit_flags(parser: argparse.ArgumentParser, argv=None) -> tuple[str, ...]:
    """The destinations of the flags given on the command line (not left at their default)."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=parser.allow_abbrev)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            probe._add_action(copy.copy(action)).default = argparse.SUPPRESS
    given, _ = probe.parse_known_args(argv)
    return tuple(sorted(vars(given)))


PATH_FLAGS = ("data_path", "eval_data_path", "tokenizer_path", "save_dir", "resume_from", "cache_dir", "from_weight")


def names_a_user_path(error: OSError, args: argparse.Namespace) -> bool:
    """Whether `error` is about a path the user named (or one inside a folder the user named):
    then it is the user's to fix (permissions, a full disk, a file where a folder belongs).
    Other OSErrors are bugs of ours and keep their traceback."""
    if not error.filename or not isinstance(error.filename, (str, bytes, os.PathLike)):
        return False
    path = os.path.abspath(os.fsdecode(error.filename))
    for name in PATH_FLAGS:
        for given in str(getattr(args, name, None) or "").split(","):
            given = split_weight(given)[0] if name == "data_path" else given
            if given and given != "none":
                given = os.path.abspath(given)
                if name in ("data_path", "eval_data_path") and not args.cache_dir:
                    given = os.path.dirname(given)  # the token cache is written next to the data by default
                if path == given or path.startswith(given.rstrip(os.sep) + os.sep) or given.startswith(path + os.sep):
                    return True
    return False


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Which flags the user set: an architecture flag that contradicts --from_weight is refused.
    args.explicit_flags = explicit_flags(parser, argv)
    problems = range_problems(args)
    if device_problem(args.device):
        problems.append(device_problem(args.device))
    if args.fsdp and args.eval_generate_samples:
        problems.append("--eval_generate_samples needs whole weights on every process, not --fsdp 1: evaluate "
                        "the answers of SAVE_DIR/best/ or model/ with scripts/eval_sft.py instead")
    if args.from_resume and args.resume_from:
        problems.append("use either --from_resume 1 or --resume_from PATH, not both")
    problems += selection_problems(args)  # before the data is read: a wrong combination fails in a second
    if problems:
        parser.error("; ".join(problems))
    if args.eval_data_path:  # several held-out files: a.jsonl,b.jsonl
        args.eval_data_path = ",".join(os.path.abspath(path) for path in args.eval_data_path.split(",") if path)
    args.data_path = absolute_data_path(args.data_path)  # every source's path, weights kept
    for name in ("tokenizer_path", "save_dir", "resume_from", "cache_dir"):
        value = getattr(args, name)
        if value:
            setattr(args, name, os.path.abspath(value))
    if args.from_weight not in ("none", "") and os.path.exists(args.from_weight):
        args.from_weight = os.path.abspath(args.from_weight)  # else a MiniMind name, resolved in SAVE_DIR
    return args


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md: every flag of `build_parser()` in one markdown table per group (name, default,
    help). scripts/write_flags_doc.py writes it; tests/test_docs.py fails while the file differs."""
    parser = parser or build_parser()

    def cell(text: str) -> str:
        text = text.replace("|", "\\|").replace("<", "\\<")
        return re.sub(r"\bdocs/([\w-]+\.md)\b", r"[docs/\1](\1)", text)

    def default(value) -> str:
        if isinstance(value, str) and value.startswith(REPO_DIR + os.sep):
            value = os.path.relpath(value, REPO_DIR)  # the same text on every machine
        return f"`{value}`"

    lines = [
        "# Flags of `train_full_sft.py`",
        "",
        "<!-- Written by scripts/write_flags_doc.py from trainer/args.py (build_parser). "
        "Change the parser and run the script; do not edit this file by hand. -->",
        "",
        "`python train_full_sft.py --help` prints the same list. Flag names follow MiniMind; a second name in",
        "a row is an alias (the names of the distributed-training guide, such as `--gradient_accumulation_steps`).",
        "Relative paths are relative to the directory you run from. `--batch_size` is per process: the global",
        "batch is `batch_size × processes × accumulation_steps`. More on some groups: [launch.md](launch.md),",
        "[fsdp.md](fsdp.md) (`--fsdp`), [data.md](data.md), [weights.md](weights.md),",
        "[evaluation.md](evaluation.md).",
    ]
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if action.option_strings and action.dest != "help"]
        if not actions:
            continue
        lines += ["", f"## {group.title}", "", "| flag | default | meaning |", "| --- | --- | --- |"]
        for action in actions:
            meaning = (action.help or "") % dict(vars(action), prog=parser.prog)
            if action.choices and not set(action.choices) <= {0, 1}:
                meaning += f" ({' | '.join(map(str, action.choices))})"
            names = " / ".join(f"`{name}`" for name in action.option_strings)
            lines.append(f"| {names} | {default(action.default)} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"
