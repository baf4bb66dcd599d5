"""Helpers for tests of the benchmark scripts (scripts/bench*.py)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "dataset" / "demo" / "sft_train.jsonl"


def demo_head(tmp_path: Path, lines: int) -> Path:
    """A jsonl file of the demo set's first `lines` conversations."""
    data = tmp_path / "small.jsonl"
    with open(DEMO, encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(lines), source)), encoding="utf-8")
    return data
