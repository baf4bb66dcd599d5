"""Command-line flags of `train_full_sft.py`, grouped by the step of the script that uses them.

Flag names follow MiniMind (`--epochs --batch_size --learning_rate ...`); the names used by
the distributed-training guide in the seed documents are accepted as aliases
(`--gradient_accumulation_steps`, `--total_steps`, `--train_data_path`, ...).
Relative paths are relative to the current directory; the defaults point into this repo.
Every numeric flag declares its range where it is declared (`add_flag`); a value outside it, or a
flag argparse refuses, stops the start with one line, `error: ...` (its control characters escaped),
and exit status 2.
"""

import argparse
import copy
import glob
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from trainer.runtime.node_lines import print_for_node

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRAIN_DATA = os.path.join(REPO_DIR, "dataset", "demo", "sft_train.jsonl")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric flag: `at_least` (allowed itself), `above` (not allowed itself),
    `at_most` (allowed itself), `below` (not allowed itself); None = unbounded on that side.
    Non-finite values (inf, nan) are always refused."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None

    def problem(self, flag: str, value) -> str | None:
        """The message for `value` of `flag` (as written: `--batch_size`) outside the range, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{flag} must be a finite number (got {value})"
        if self.at_least is not None and value < self.at_least:
            return f"{flag} must be >= {self.at_least} (got {value})"
        if self.above is not None and value <= self.above:
            return f"{flag} must be > {self.above} (got {value})"
        if self.at_most is not None and value > self.at_most:
            return f"{flag} must be <= {self.at_most} (got {value})"
        if self.below is not None and value >= self.below:
            return f"{flag} must be < {self.below} (got {value})"
        return None

    def text(self) -> str:
        """The range as docs/flags.md shows it: `>= 1`, `> 0`, `0 to 1`, `>= 0, < 1`."""
        if self.at_least is not None and self.at_most is not None:
            return f"{self.at_least} to {self.at_most}"
        signs = ((">=", self.at_least), (">", self.above), ("<=", self.at_most), ("<", self.below))
        parts = [f"{sign} {value}" for sign, value in signs if value is not None]
        return ", ".join(parts)


def add_flag(group, *names: str, at_least=None, above=None, at_most=None, below=None, **kwargs) -> argparse.Action:
    """A numeric flag with its range: `group.add_argument(*names, **kwargs)`, the range kept on the
    flag and checked by `parse_args`."""
    action = group.add_argument(*names, **kwargs)
    action.bounds = Bounds(at_least, above, at_most, below)
    return action


def path_value(text: str) -> str:
    """The argparse type of a flag that names a file or folder: an empty value (an unset shell
    variable) is refused, where it would mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give a file or folder")
    return text


# How a help names its flag's default itself: "(default: the tokenizer's)", "(default 15)",
# "default: next to the data", "by default the repository's"; not "its default experts".
NAMES_ITS_DEFAULT = re.compile(r"\(default\b|\bdefault:|\bby default\b")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help followed by its default, unless the help names its default itself
    (`NAMES_ITS_DEFAULT`) or it has none (None): ``(default: None)`` after such a help would
    contradict it. The trainer's --help and the scripts' (scripts/_common.py)."""

    def _get_help_string(self, action):
        if action.default is None or NAMES_ITS_DEFAULT.search(action.help or ""):
            return action.help
        return super()._get_help_string(action)


class FlagParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, `error: ...` (exit 2), not the usage first. Every
    process of a launch parses the same flags: one of each node prints the line. The line quotes the
    values given, so it is escaped as every line naming a user's file (`dataset.printable`): a value
    holding a control character cannot steer the terminal."""

    def error(self, message: str) -> NoReturn:
        from dataset.printable import printable  # here, not at the top: importing the flags imports no data code

        print_for_node(printable(f"error: {message}", one_line=True))
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        description="Full-parameter SFT of a MiniMind model (python, torchrun, multi-node, SLURM).",
        formatter_class=HelpFormatter,
    )
    dist = parser.add_argument_group("1. distributed")
    dist.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                      help="process-group backend; auto = nccl with CUDA, else gloo")
    add_flag(dist, "--dist_timeout", type=float, default=600.0, above=0, at_most=7 * 24 * 3600,
             help="seconds a collective (or a missing peer) may block before the run fails")
    dist.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto/cuda: cuda:LOCAL_RANK, or a task's own GPU under srun --gpus-per-task)")
    add_flag(dist, "--world_size", type=int, default=1, at_least=1,
             help="start this many local workers yourself (for machines without torchrun)")
    dist.add_argument("--fsdp", type=int, choices=(0, 1), default=0,
                      help="1 = shard weights, gradients and optimizer state over the processes (FSDP2) instead of DDP")
    add_flag(dist, "--local_rank", "--local-rank", type=int, default=None, at_least=0,
             help="set by the legacy `python -m torch.distributed.launch`; not for users")

    seed = parser.add_argument_group("2. seed")
    add_flag(seed, "--seed", type=int, default=42, at_least=0, at_most=2**32 - 1,
             help="base seed; each rank uses seed + rank")

    cfg = parser.add_argument_group("3. model config and resume")
    add_flag(cfg, "--hidden_size", type=int, default=768, at_least=1, help="model width (MiniMind: 512 or 768)")
    add_flag(cfg, "--num_hidden_layers", type=int, default=8, at_least=1, help="transformer blocks")
    add_flag(cfg, "--num_attention_heads", type=int, default=8, at_least=1, help="query heads; must divide hidden_size")
    add_flag(cfg, "--num_key_value_heads", type=int, default=4, at_least=1,
             help="key/value heads (GQA); must divide the query heads")
    cfg.add_argument("--use_moe", type=int, choices=(0, 1), default=0, help="1 = top-k routed mixture-of-experts MLPs")
    add_flag(cfg, "--num_experts", type=int, default=4, at_least=1, help="experts per MoE layer")
    add_flag(cfg, "--num_experts_per_tok", type=int, default=1, at_least=1, help="experts each token is routed to")
    add_flag(cfg, "--rms_norm_eps", type=float, default=1e-6, above=0,
             help="epsilon of every RMSNorm (MiniMind and Qwen3: 1e-6)")
    add_flag(cfg, "--aux_loss_coef", type=float, default=5e-4, at_least=0,
             help="MoE load-balancing loss coefficient (the config's router_aux_loss_coef)")
    add_flag(cfg, "--dropout", type=float, default=0.0, at_least=0, below=1,
             help="dropout on embeddings, attention and MLP outputs")
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
    add_flag(data, "--max_seq_len", type=int, default=512, at_least=2, help="samples are truncated to this many tokens")
    data.add_argument("--packing", type=int, choices=(0, 1), default=0,
                      help="1 = concatenate samples into rows of max_seq_len (attention kept per document)")
    data.add_argument("--group_by_length", type=int, choices=(0, 1), default=1,
                      help="1 = batch samples of similar length together (batch order stays random); "
                           "0 = plain shuffled batches (more padding)")
    data.add_argument("--bad_data", choices=("error", "skip"), default="error",
                      help="what to do with a malformed data line")
    add_flag(data, "--num_workers", type=int, default=None, at_least=0,
             help="DataLoader workers; default on CUDA: up to 4 per process, from the spare cores; on CPU 0")
    data.add_argument("--cache_dir", default=None, type=path_value, help="where the tokenized cache lives; default next to the data")
    add_flag(data, "--system_prompt_ratio", type=float, default=0.0, at_least=0, at_most=1,
             help="augmentation: this fraction of the samples without a system prompt (or tools) draw a random "
                  "one, per (seed, epoch, sample); it is added where the sample and it fit in --max_seq_len (a "
                  "sample is never cut for it; the start summary says how many fit), and --packing 1 plans rows "
                  "with room for it (MiniMind: 0.2)")
    add_flag(data, "--drop_empty_think_ratio", type=float, default=0.0, at_least=0, at_most=1,
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
    add_flag(loop, "--epochs", type=int, default=1, at_least=1, help="passes over the training data")
    add_flag(loop, "--max_steps", "--total_steps", type=int, default=0, at_least=0,
             help="stop after this many optimizer steps (0 = run all epochs)")
    add_flag(loop, "--batch_size", type=int, default=16, at_least=1, help="samples per process per micro-step")
    add_flag(loop, "--accumulation_steps", "--gradient_accumulation_steps", type=int, default=1, at_least=1,
             help="micro-batches per optimizer step (gradients all-reduced once per step)")
    add_flag(loop, "--learning_rate", type=float, default=5e-4, above=0, help="peak LR of the cosine schedule")
    add_flag(loop, "--min_lr_ratio", type=float, default=0.1, at_least=0, at_most=1,
             help="cosine floor as a fraction of the peak LR")
    add_flag(loop, "--warmup_steps", type=int, default=None, at_least=0,
             help="default: 3%% of all steps, rounded, at least 1 (0 for a one-step run), counted at the run's first "
                  "start; a resume without the flag keeps its checkpoint's")
    add_flag(loop, "--weight_decay", type=float, default=0.01, at_least=0, help="AdamW weight decay (matrices only)")
    add_flag(loop, "--grad_clip", type=float, default=1.0, at_least=0, help="clip the global gradient norm (0 = off)")
    loop.add_argument("--dtype", choices=DTYPES, default="auto",
                      help="autocast dtype; auto = float32 on CPU; on GPU bfloat16 where native (compute "
                           "capability 8.0+), else float16")
    loop.add_argument("--tf32", choices=("auto", "0", "1"), default="auto",
                      help="TF32 tensor cores for the float32 matmuls of a CUDA run: auto = with --dtype bfloat16 or "
                           "float16 only (--dtype float32 computes in IEEE float32), 1 = always, 0 = never")
    add_flag(loop, "--max_bad_steps", type=int, default=5, at_least=1,
             help="stop after this many non-finite optimizer steps in a row")

    evl = parser.add_argument_group("6b. evaluation (needs --eval_data_path)")
    add_flag(evl, "--eval_interval", type=int, default=0, at_least=0,
             help="evaluate every N optimizer steps (0 = only at the end): loss and token accuracy on "
                  "every held-out file")
    add_flag(evl, "--eval_generate_samples", type=int, default=0, at_least=0,
             help="also answer the first N conversations of each held-out file greedily and report "
                  "eval_exact_match and, where the answers call tools, eval_tool_call_accuracy (0 = off; "
                  "ranks share the work)")
    add_flag(evl, "--eval_max_new_tokens", type=int, default=64, at_least=1, help="most tokens generated per answer")
    evl.add_argument("--keep_best", default=None, metavar="METRIC",
                     help="keep the model of the best evaluation in SAVE_DIR/best/ (with best.json): eval_loss "
                          "(lower is better), eval_token_accuracy, eval_exact_match, eval_tool_call_accuracy "
                          "(higher), or a per-file key such as eval_loss/NAME")
    add_flag(evl, "--early_stop_patience", type=int, default=0, at_least=0,
             help="stop (and save) after N evaluations without improvement of --keep_best (0 = off)")

    save = parser.add_argument_group("7. saving")
    save.add_argument("--save_dir", default="out", type=path_value, help="checkpoints/, model/ and metrics.jsonl go here")
    add_flag(save, "--save_interval", type=int, default=100, at_least=0,
             help="save every N optimizer steps (0 = only at the end)")
    add_flag(save, "--save_every_minutes", type=float, default=0.0, at_least=0,
             help="also save when M minutes have passed since the last save, whichever of the two comes first "
                  "(rank 0's clock, checked before every optimizer step; 0 = off)")
    save.add_argument("--save_dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                      help="dtype of the inference weights (resume checkpoints are always fp32)")
    add_flag(save, "--keep_last", type=int, default=3, at_least=1, help="resume checkpoints to keep")
    save.add_argument("--overwrite", type=int, choices=(0, 1), default=0,
                      help="1 = start a new run, or resume another run's checkpoint (--resume_from), in a "
                           "--save_dir that holds another run (its files are moved to <save_dir>/set_aside/, not "
                           "deleted)")
    save.add_argument("--save_weight", default=None,
                      help="MiniMind's prefix: also write SAVE_DIR/PREFIX_HIDDEN[_moe].pth (fp16, MiniMind's state dict, "
                           "for its eval_llm.py) at every save, e.g. --save_weight full_sft")

    log = parser.add_argument_group("8. logging")
    add_flag(log, "--log_interval", type=int, default=10, at_least=1,
             help="print and record figures every N optimizer steps")
    log.add_argument("--use_wandb", type=int, choices=(0, 1), default=0, nargs="?", const=1,
                     help="1 (or bare --use_wandb) = also log to wandb (WANDB_MODE=offline works; a resumed run continues "
                          "its wandb run; charts plot against the train/step metric, so steps logged again after a "
                          "resume are kept)")
    log.add_argument("--wandb_project", default="minisft", help="wandb project")
    log.add_argument("--wandb_run_name", default=None, help="wandb run name")
    return parser


DEVICE_HELP = "use auto, cpu, cuda or cuda:N"


def range_problems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """One message per numeric flag outside the range it was declared with (unset flags are skipped),
    naming the flag by its first long option (`--rows`, whatever its `dest`); a positional argument
    by its name."""
    problems = []
    for action in parser._actions:
        bounds, value = getattr(action, "bounds", None), getattr(args, action.dest, None)
        if bounds is not None and value is not None:
            name = next((option for option in action.option_strings if option.startswith("--")), action.dest)
            problems.append(bounds.problem(name, value))
    return [problem for problem in problems if problem]


def flag_bounds(dest: str) -> Bounds:
    """The range the trainer declares for the flag `dest` (a script sharing the flag checks the same)."""
    return next(action.bounds for action in build_parser()._actions if action.dest == dest)


def device_problem(device: str) -> str | None:
    """`--device` must name a device this trainer runs on; mps, xla, gpu, ... are refused here."""
    if device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device):
        return None
    if device in ("gpu", "gpu:0") or re.fullmatch(r"gpu:\d+", device):
        return f"--device {device}: unknown device; for an NVIDIA GPU use cuda or cuda:N"
    return f"--device {device}: not supported ({DEVICE_HELP})"


def held_out_files(text: str | None) -> list[str]:
    """The files of --eval_data_path, split as --data_path's sources are (``dataset.mixture.split_commas``:
    a path with commas that exists as written is one file). Imported when there is a list to split:
    dataset.mixture imports torch, and importing the flags imports none."""
    if not text:
        return []
    from dataset.mixture import split_commas

    return split_commas(text)


def held_out_problem(path: str) -> str | None:
    """A held-out file given as `FILE:N` where FILE exists: --eval_data_path takes no weight (only
    --data_path weighs its sources) and no line number; or as a glob, which it does not expand."""
    from dataset.mixture import is_glob  # imported with held_out_files' split: dataset.mixture imports torch

    matches = sorted(glob.glob(path, recursive=True)) if is_glob(path) and not os.path.exists(path) else []
    if matches:
        return (f"--eval_data_path {path}: no such file; held-out files are named one by one, comma-separated "
                f"(only --data_path reads a glob): {','.join(matches)}")
    head, colon, tail = path.rpartition(":")
    if os.path.exists(path) or not colon or not re.fullmatch(r"[0-9.eE+-]+", tail) or not os.path.isfile(head):
        return None
    return (f"--eval_data_path {path}: no such file, but {head} is one: held-out files are read whole, without a "
            "':weight' (only --data_path weighs its sources) or a line number")


def explicit_flags(parser: argparse.ArgumentParser, argv=None) -> tuple[str, ...]:
    """The destinations of the flags given on the command line (not left at their default)."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=parser.allow_abbrev)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            probe._add_action(copy.copy(action)).default = argparse.SUPPRESS
    given, _ = probe.parse_known_args(argv)
    return tuple(sorted(vars(given)))


def parse_args(argv=None, checks: tuple[Callable[[argparse.Namespace], list[str]], ...] = ()) -> argparse.Namespace:
    """The flags of `argv` (default: the command line), checked; one line and exit 2 for any problem.

    `checks`: functions of the parsed flags that return problems, for the values another module
    owns (train_full_sft.py passes the checkpoint selection's); reported with the ranges' in the
    same line, before any slow work."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Which flags the user set: an architecture flag that contradicts --from_weight is refused.
    args.explicit_flags = explicit_flags(parser, argv)
    problems = range_problems(parser, args)
    if device_problem(args.device):
        problems.append(device_problem(args.device))
    if args.fsdp and args.eval_generate_samples:
        problems.append("--eval_generate_samples needs whole weights on every process, not --fsdp 1: evaluate "
                        "the answers of SAVE_DIR/best/ or model/ with scripts/eval_sft.py instead")
    if args.from_resume and args.resume_from:
        problems.append("use either --from_resume 1 or --resume_from PATH, not both")
    if not args.eval_data_path:  # evaluation asked for, with nothing to evaluate: said, not skipped
        problems += [f"--{name} {getattr(args, name)} needs held-out data: give --eval_data_path"
                     for name in ("eval_interval", "eval_generate_samples") if getattr(args, name)]
    if "eval_max_new_tokens" in args.explicit_flags and not args.eval_generate_samples:  # no answer is generated
        problems.append(f"--eval_max_new_tokens {args.eval_max_new_tokens} sets the length of generated answers: "
                        "give --eval_generate_samples N")
    problems += [problem for problem in map(held_out_problem, held_out_files(args.eval_data_path)) if problem]
    for check in checks:
        problems += check(args)
    if problems:
        parser.error("; ".join(problems))
    if args.eval_data_path:  # several held-out files: a.jsonl,b.jsonl
        args.eval_data_path = ",".join(os.path.abspath(path) for path in held_out_files(args.eval_data_path))
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
            if getattr(action, "bounds", None):
                meaning += f" (range: {action.bounds.text()})"
            names = " / ".join(f"`{name}`" for name in action.option_strings)
            lines.append(f"| {names} | {default(action.default)} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"
