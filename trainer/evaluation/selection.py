"""Which checkpoint to keep: the best model by one eval metric, and early stopping.

`--keep_best METRIC` (e.g. `eval_loss`, `eval_token_accuracy`, `eval_exact_match`, or a
per-file key such as `eval_loss/tools`): after every evaluation that improves METRIC (strictly:
lower for losses, higher for accuracies), rank 0 writes the inference weights to
`<save_dir>/best/` (atomically, like `model/`) with `best.json` = {metric, value, step}.
`--early_stop_patience N` stops the run after N evaluations in a row without improvement; every
rank decides on the same all-reduced figures, so all stop at the same step, and the run saves.

The state (the metric, its best value and step, evaluations since) lives in `TrainState` and so in
every resume checkpoint: a resumed run keeps comparing against the best of the run before. A resume
with another --keep_best, or whose held-out data differs from what the best was measured on
(`measured_on`: the files' content, --max_seq_len, the tokenizer and chat template, how many of their
rows are samples; for the scores of generated answers also their number and --eval_max_new_tokens),
starts the selection afresh and moves the other best/ aside (trainer/loop/state.py), since values of
two metrics, or of one metric on two held-out sets, cannot be compared. A resume to a step before the
one in best.json (a rollback) moves that best/ aside with the later checkpoints.
"""

from __future__ import annotations

import json
import re

from dataset.mixture import short_names
from trainer.args import held_out_files
from trainer.errors import SelectionError

# The figures an evaluation reports, and whether a smaller value is better.
METRICS = {"eval_loss": "min", "eval_token_accuracy": "max", "eval_exact_match": "max", "eval_tool_call_accuracy": "max"}
GENERATED = ("eval_exact_match", "eval_tool_call_accuracy")  # reported only with --eval_generate_samples
# The rule by which `evaluate.generation_examples` picks a held-out file's generation prompts (2: none
# from a sample of --max_seq_len tokens), in `measured_on`: a best judged on prompts another rule
# picked is not compared with this run's scores.
PROMPT_RULE = 2


def eval_set_names(paths: list[str]) -> list[str]:
    """Short, distinct names for the held-out files: the file name without its data suffixes
    (named like the training sources); a per-file metric is KEY/NAME."""
    return short_names(paths, fallback="eval")


def metric_mode(metric: str) -> str:
    """'min' for losses, 'max' for accuracies and match rates."""
    return "min" if metric.split("/")[0].endswith("loss") else "max"


def improves(value: float | None, best: float | None, mode: str) -> bool:
    if value is None or value != value:  # missing or NaN: never an improvement
        return False
    if best is None:
        return True
    return value < best if mode == "min" else value > best


def flag_problems(args) -> list[str]:
    """What the flags alone say about --keep_best / --early_stop_patience, checked by parse_args
    before any slow work (the data is not read yet; `check_selection` checks the rest later)."""
    metric = args.keep_best
    if not metric:
        return ["--early_stop_patience needs --keep_best METRIC (the metric that must improve)"] \
            if args.early_stop_patience else []
    paths = held_out_files(args.eval_data_path)
    if not paths:
        return [f"--keep_best {metric} needs held-out data: give --eval_data_path"]
    if args.early_stop_patience and not args.eval_interval:  # one evaluation: nothing to be patient for
        return [f"--early_stop_patience {args.early_stop_patience} needs --eval_interval N: with 0 the only "
                "evaluation is the one at the end"]
    key, _, name = metric.partition("/")
    if key not in METRICS:
        return [f"--keep_best {metric}: unknown metric (use {', '.join(METRICS)}, or KEY/NAME for one held-out file)"]
    if key in GENERATED and not args.eval_generate_samples:
        return [f"--keep_best {metric} needs --eval_generate_samples N (answers are generated only then)"]
    names = eval_set_names(paths) if len(paths) > 1 else []
    if "/" in metric and name not in names:
        known = f"the held-out files are named {', '.join(names)}" if names else "a single held-out file has no per-file keys"
        return [f"--keep_best {metric}: no held-out file named {name!r} ({known})"]
    return []


def check_selection(args, metric_names: list[str]) -> None:
    """Fail before training when --keep_best names a metric this run will not report (the data
    decides: e.g. no tool-calling turn, no eval_tool_call_accuracy)."""
    problems = flag_problems(args)
    if problems:
        raise SelectionError(problems[0])
    if args.keep_best and args.keep_best not in metric_names:
        raise SelectionError(f"--keep_best {args.keep_best}: this run reports no such metric "
                             f"(it reports: {', '.join(metric_names)})")


SAMPLES_OF = " of {} samples"  # after a held-out file's key in `measured_on`
_SAMPLES_OF = re.compile(re.escape(SAMPLES_OF).replace(re.escape("{}"), r"\d+") + "$")


def measured_on(eval_sets, metric: str, max_new_tokens: int) -> list[str]:
    """What the values of `metric` are measured on: for each held-out file it covers (for `KEY/NAME`
    the file NAME alone, else all of them, sorted: their sums do not depend on the order) its key
    (`EvalSet.data_key`) and how many of its rows are samples (another rule of bad rows may accept
    others), as "KEY of N samples"; for a metric of generated answers (GENERATED), also how many
    answers (the first of each file, --eval_generate_samples, picked by `PROMPT_RULE`) of at most how
    many tokens (--eval_max_new_tokens) were judged. Values measured on other data cannot be compared
    (`same_measurement`)."""
    key, _, name = metric.partition("/")
    covered = [eval_set for eval_set in eval_sets if not name or eval_set.name == name]
    data = sorted(f"{eval_set.data_key}{SAMPLES_OF.format(eval_set.num_samples)}" for eval_set in covered)
    if key not in GENERATED:
        return data
    answers = sum(eval_set.num_replies + eval_set.num_tool_turns for eval_set in covered)
    return [*data, f"{answers} generated answers (prompt rule {PROMPT_RULE}) of at most {max_new_tokens} tokens"]


def same_measurement(recorded: list, current: list[str]) -> bool:
    """Whether values measured on `recorded` (a `measured_on` of a checkpoint or best.json) compare with
    this run's, measured on `current`. A record that names a held-out file by its key alone, without
    its number of samples, is compared on what both hold: the key."""
    return len(recorded) == len(current) and all(
        old == new or old == _SAMPLES_OF.sub("", new) for old, new in zip(recorded, current))


def measured_with(metric: str) -> tuple[str, str]:
    """What `measured_on` records for `metric`, in words, and the flags that set it, for the lines that
    say it differs."""
    if metric.partition("/")[0] in GENERATED:
        return "held-out data or generated answers", "--eval_data_path, --eval_generate_samples or --eval_max_new_tokens"
    return "held-out data", "--eval_data_path"


def update_selection(state, metric: str, figures: dict, patience: int, data: list[str]) -> tuple[bool, bool]:
    """Record one evaluation (of `metric`, measured on `data`) in `state` (a TrainState).
    Returns (new best, stop now)."""
    value = figures.get(metric)
    if improves(value, state.best_value, metric_mode(metric)):
        state.best_value, state.best_step, state.evals_without_improvement = value, state.step, 0
        state.best_metric, state.best_measured_on = metric, data
        return True, False
    state.evals_without_improvement += 1
    return False, patience_spent(state, patience)


def patience_spent(state, patience: int) -> bool:
    """Whether `state` holds `patience` evaluations in a row without improvement (never with 0)."""
    return bool(patience) and state.evals_without_improvement >= patience


def best_record(metric: str, value: float, step: int, data: list[str]) -> str:
    """The content of best.json (`measured_on`: the held-out data's keys, `measured_on`)."""
    return json.dumps({"metric": metric, "mode": metric_mode(metric), "value": value, "step": step,
                       "measured_on": data}, indent=2) + "\n"


def stopped_early(state, metric: str | None, patience: int) -> str | None:
    """What to say where the selection a resume carries already holds `patience` evaluations without
    improvement of `metric` (the run it continues stopped early there, or its last evaluation was one
    more without improvement), else None: training on would take steps up to the next evaluation
    and stop there."""
    if not (metric and patience_spent(state, patience)):
        return None
    best = f" (best {state.best_value:.4f} at step {state.best_step})" if state.best_value is not None else ""
    count = state.evals_without_improvement
    return (f"nothing left to train: {metric} has not improved in the checkpoint's last {count} evaluations{best}, "
            f"where --early_stop_patience {patience} stops the run; raise --early_stop_patience, or give 0, to train further")
