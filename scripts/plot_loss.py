"""Plot a training run's metrics.jsonl: train/eval loss, learning rate and tokens/s over steps.

    python scripts/plot_loss.py --metrics out [--out out/loss.png]

``--metrics`` is a metrics.jsonl or a run directory holding one. A resumed run appends to the same
file, so steps after the crashed run's last checkpoint appear twice: for every (kind, step) the
last line wins, which gives one continuous curve.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._common import ArgumentParser, fail, run_main  # noqa: E402


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0], prog="plot_loss.py")
    parser.add_argument("--metrics", required=True, help="metrics.jsonl, or a run directory (--save_dir) with one")
    parser.add_argument("--out", default=None, help="PNG to write (default: loss.png next to the metrics file)")
    parser.add_argument("--title", default=None, help="figure title (default: the metrics path)")
    return parser


def metrics_file(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


def read_metrics(path: Path) -> list[dict]:
    """All JSON object lines of the file; a malformed line is skipped with a warning (e.g. a crash mid-write)."""
    if not path.is_file():
        fail(f"{path}: metrics file not found")
    records, bad = [], []
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad.append(number)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                bad.append(number)
    if bad:
        print(f"warning: {path}: skipped {len(bad)} malformed line(s) (first: line {bad[0]})", file=sys.stderr)
    if not records:
        fail(f"{path}: no metrics lines (empty file?)")
    return records


def dedupe_metrics(records: list[dict]) -> dict[str, list[dict]]:
    """Per kind, the last record of every step, sorted by step (resumed runs repeat some steps)."""
    latest: dict[str, dict[int, dict]] = {}
    for record in records:
        latest.setdefault(record.get("kind", "train"), {})[record["step"]] = record
    return {kind: [steps[s] for s in sorted(steps)] for kind, steps in latest.items()}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    points = [(s, v) for s, v in points if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def plot(curves: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = curves.get("train", []), curves.get("eval", [])
    figure, (loss_axis, lr_axis, speed_axis) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    loss_axis.plot(*_series(train, "loss"), label="train loss", linewidth=1.2)
    if evals:
        loss_axis.plot(*_series(evals, "eval_loss"), "o-", label="eval loss", linewidth=1.5, markersize=4)
    loss_axis.set_ylabel("loss")
    loss_axis.legend()
    loss_axis.set_title(title)
    lr_axis.plot(*_series(train, "lr"), color="tab:green")
    lr_axis.set_ylabel("learning rate")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    speed_axis.plot(*_series(train, "tokens_per_s"), color="tab:red")
    speed_axis.set_ylabel("tokens / s")
    speed_axis.set_xlabel("optimizer step")
    for axis in (loss_axis, lr_axis, speed_axis):
        axis.grid(True, alpha=0.3)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = metrics_file(Path(args.metrics))
    curves = dedupe_metrics(read_metrics(path))
    if not curves.get("train"):
        fail(f"{path}: no train lines (kind 'train') to plot")
    out = Path(args.out) if args.out else path.parent / "loss.png"
    if out.suffix.lower() != ".png":
        fail(f"--out {out}: expected a .png file name")
    plot(curves, out, args.title or str(path))
    train = curves["train"]
    print(f"wrote {out}: {len(train)} train steps ({train[0]['step']}..{train[-1]['step']}), "
          f"{len(curves.get('eval', []))} eval points")
    return 0


if __name__ == "__main__":
    run_main(main)
