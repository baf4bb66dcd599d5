"""Plot a training run's metrics.jsonl: train/eval losses, eval accuracies, learning rate and tokens/s.

    python scripts/plot_loss.py --metrics out [--out out/loss.png]

``--metrics`` is a metrics.jsonl or a run directory holding one. A resumed run appends to the same
file, so steps after the crashed run's last checkpoint appear twice: for every (kind, step) the
last line wins, which gives one continuous curve. Every line names its run (``run_id``): one run is
plotted, the one of the file's last line, unless ``--runs all`` (lines without a run id count as one run).
A rollback's run goes on from the run it left (its lines' ``rolled_back_from``): that run's lines up
to the step it left it at are plotted with it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import ArgumentParser, check_output_file, fail, run_main  # noqa: E402
from trainer.args import path_value  # noqa: E402


# Eval keys drawn on the accuracy panel (with their per-file `/<name>` variants).
ACCURACY_PREFIXES = ("eval_token_accuracy", "eval_exact_match", "eval_tool_call_accuracy")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="plot_loss.py")
    parser.add_argument("--metrics", required=True, help="metrics.jsonl, or a run directory (--save_dir) with one")
    parser.add_argument("--out", default=None, type=path_value, help="PNG to write (default: loss.png next to the metrics file)")
    parser.add_argument("--title", default=None, help="figure title (default: the metrics path)")
    parser.add_argument("--runs", choices=("latest", "all"), default="latest",
                        help="latest: only the lines of the run (run_id) of the file's last line; all: every line")
    return parser


def metrics_file(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


# What a line that is not a metrics line is, in the order a refusal counts them: (one, several).
LINE_KINDS = {
    "not_json": ("not JSON", "not JSON"),
    "not_object": ("JSON value that is not an object", "JSON values that are not objects"),
    "conversation": ("conversation row", "conversation rows"),
    "no_step": ('object without an integer "step"', 'objects without an integer "step"'),
    "bad_key": ('object whose "kind" or "run_id" is not a string',
                'objects whose "kind" or "run_id" is not a string'),
    "blank": ("blank", "blank"),
}


def read_metrics(path: Path) -> list[dict]:
    """All metrics lines of the file; a malformed line is skipped with a warning (e.g. a crash mid-write).
    A file without one is refused in one line that says what its lines are."""
    if not path.is_file():
        fail(f"{path}: metrics file not found")
    records, bad, kinds = [], [], dict.fromkeys(LINE_KINDS, 0)
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                kinds["blank"] += 1
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError; an int of over 4300 digits; deep nesting
                kinds["not_json"] += 1
            else:
                kind = line_kind(record)
                if kind is None:
                    records.append(record)
                    continue
                kinds[kind] += 1
            bad.append(number)
    if not records:
        fail(f"{path}: {no_metrics_found(kinds)}")
    if bad:
        print(f"warning: {path}: skipped {len(bad)} malformed line(s) (first: line {bad[0]})", file=sys.stderr)
    return records


def no_metrics_found(kinds: dict[str, int]) -> str:
    """What a file without a metrics line holds, from the count of its lines of each LINE_KINDS kind."""
    total = sum(kinds.values())
    if not total:
        return "empty file (0 bytes): no metrics line to plot"
    found = ", ".join(f"{count} {LINE_KINDS[kind][count > 1]}" for kind, count in kinds.items() if count)
    lines = f"none of its {total} lines is" if total > 1 else "its one line is not"
    return f"{lines} a metrics line ({found}): not a metrics.jsonl written by train_full_sft.py"


def line_kind(record) -> str | None:
    """None for a metrics line, else its LINE_KINDS kind. A conversation row is what a data file holds
    (dataset/formats.py: a `conversations` or `messages` key)."""
    if is_metrics_line(record):
        return None
    if not isinstance(record, dict):
        return "not_object"
    if "conversations" in record or "messages" in record:
        return "conversation"
    return "no_step" if not is_step(record.get("step")) else "bad_key"


def is_step(value) -> bool:
    """An integer from 0 to 2**53 (an axis value a float holds exactly) that is not a bool: JSON's
    `true` reads as Python's True, an int equal to 1, which would take the place of step 1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53


def is_metrics_line(record) -> bool:
    """A JSON object with an integer step and, where present, a string kind and run_id (they key the
    curves and the runs)."""
    return (isinstance(record, dict) and is_step(record.get("step"))
            and all(isinstance(record.get(key), (str, type(None))) for key in ("kind", "run_id")))


def latest_run(records: list[dict]) -> tuple[list[dict], str | None]:
    """The records of the run of the last record (by `run_id`), with those of the runs it rolled back
    from up to where it left them, and a note naming what was left out, or None."""
    run_id = records[-1].get("run_id")
    last_step = {run_id: math.inf}  # run id -> its last step plotted
    current, before = run_id, ""
    while (left := rolled_back_from(records, current)) and left["run_id"] not in last_step:
        current = left["run_id"]
        last_step[current] = left["step"]
        before += f", with run {current} up to step {left['step']}"
    kept = [record for record in records
            if record.get("run_id") in last_step and record["step"] <= last_step[record.get("run_id")]]
    others = {record.get("run_id") for record in records} - set(last_step)
    if len(kept) == len(records):
        return records, None
    left_out = f"; {len(others)} other run(s) in this file are left out" if others else ""
    return kept, (f"note: plotted run {run_id}{before} ({len(kept)} of {len(records)} lines){left_out} "
                  "(--runs all plots every line)")


def rolled_back_from(records: list[dict], run_id) -> dict | None:
    """The {run_id, step} that a line of the run `run_id` records as the run it rolled back from, or None."""
    for record in records:
        left = record.get("rolled_back_from")
        if (record.get("run_id") == run_id and isinstance(left, dict) and isinstance(left.get("run_id"), str)
                and is_step(left.get("step"))):
            return left
    return None


def dedupe_metrics(records: list[dict]) -> dict[str, list[dict]]:
    """Per kind, the last record of every step, sorted by step (resumed runs repeat some steps)."""
    latest: dict[str, dict[int, dict]] = {}
    for record in records:
        latest.setdefault(record.get("kind", "train"), {})[record["step"]] = record
    return {kind: [steps[s] for s in sorted(steps)] for kind, steps in latest.items()}


def number(value) -> float | None:
    """A metric's value as a float: None for a bool (JSON's true is 1 to Python), a non-number, or an
    integer beyond the float range (JSON allows any)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], number(r.get(key))) for r in records]
    points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def keys_with_prefix(records: list[dict], prefixes: tuple[str, ...]) -> list[str]:
    """The numeric keys of these records that start with one of `prefixes`, the plain ones first."""
    found = {key for record in records for key, value in record.items()
             if key.startswith(prefixes) and number(value) is not None}
    return sorted(found, key=lambda key: ("/" in key, key))


def loss_keys(records: list[dict], name: str) -> list[str]:
    """The loss curves' keys: ``name`` and its per-source or per-file ``name/<part>`` variants, not the
    other keys it begins (``eval_loss_tokens`` is a count of tokens)."""
    return [key for key in keys_with_prefix(records, (name,)) if key == name or key.startswith(f"{name}/")]


def has_a_loss(curves: dict[str, list[dict]]) -> bool:
    """Whether any train or eval loss curve has a finite point to draw."""
    for kind, name in (("train", "loss"), ("eval", "eval_loss")):
        records = curves.get(kind, [])
        if any(_series(records, key)[0] for key in loss_keys(records, name)):
            return True
    return False


def plot(curves: dict[str, list[dict]], out: Path, title: str) -> list[str]:
    """Losses (train, any per-source `loss/<source>`, eval and per-file `eval_loss/<name>`), the
    eval accuracies when there are any, learning rate and tokens/s; the best step of --keep_best
    as a dotted line. Returns the labels of the loss and accuracy curves drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = curves.get("train", []), curves.get("eval", [])
    accuracy_keys = keys_with_prefix(evals, ACCURACY_PREFIXES)
    rows = 4 if accuracy_keys else 3
    figure, axes = plt.subplots(rows, 1, figsize=(9, 3.2 * rows + 0.4), sharex=True)
    loss_axis, speed_axis = axes[0], axes[-1]
    for key in loss_keys(train, "loss"):
        loss_axis.plot(*_series(train, key), label=f"train {key}", linewidth=1.2 if key == "loss" else 0.9)
    for key in loss_keys(evals, "eval_loss"):
        loss_axis.plot(*_series(evals, key), "o-", label=key.replace("_", " "), linewidth=1.5, markersize=4)
    loss_axis.set_ylabel("loss")
    loss_axis.legend(fontsize="small")
    loss_axis.set_title(title)
    if accuracy_keys:
        for key in accuracy_keys:
            axes[1].plot(*_series(evals, key), "o-", label=key.replace("_", " "), markersize=4)
        axes[1].set_ylabel("eval accuracy")
        axes[1].legend(fontsize="small")
    lr_axis = axes[-2]
    lr_axis.plot(*_series(train, "lr"), color="tab:green")
    lr_axis.set_ylabel("learning rate")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    speed_axis.plot(*_series(train, "tokens_per_s"), color="tab:red")
    speed_axis.set_ylabel("tokens / s")
    speed_axis.set_xlabel("optimizer step")
    best = [r for r in evals if is_step(r.get("best_step")) and isinstance(r.get("best_metric"), str)]
    for axis in axes:
        axis.grid(True, alpha=0.3)
        if best:
            axis.axvline(best[-1]["best_step"], color="gray", linestyle=":", linewidth=1)
    if best:
        loss_axis.annotate(f"best {best[-1]['best_metric']} (step {best[-1]['best_step']})",
                           (best[-1]["best_step"], 1.0), xycoords=("data", "axes fraction"), fontsize="small",
                           va="top", ha="right", color="gray")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    labels = [line.get_label() for axis in axes[:rows - 2] for line in axis.get_lines()
              if not line.get_label().startswith("_")]  # not the best-step line
    plt.close(figure)
    return labels


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = metrics_file(Path(args.metrics))
    records, note = read_metrics(path), None
    if args.runs == "latest":
        records, note = latest_run(records)
    if note:
        print(note)
    curves = dedupe_metrics(records)
    if not curves.get("train"):
        fail(f"{path}: no train lines (kind 'train') to plot")
    if not has_a_loss(curves):  # every interval skipped logs "loss": null
        fail(f"{path}: no finite loss in its {len(curves['train'])} train lines (every step skipped?): nothing to plot")
    out = Path(args.out) if args.out else path.parent / "loss.png"
    if out.suffix.lower() != ".png":
        fail(f"--out {out}: expected a .png file name")
    check_output_file(str(out), "--out")
    plot(curves, out, args.title or str(path))
    train = curves["train"]
    print(f"wrote {out}: {len(train)} train steps ({train[0]['step']}..{train[-1]['step']}), "
          f"{len(curves.get('eval', []))} eval points")
    return 0


if __name__ == "__main__":
    run_main(main)
