"""Helpers for tests that run the benchmark scripts (scripts/bench*.py) in a fresh process."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "dataset" / "demo" / "sft_train.jsonl"


def run_bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python scripts/<script> ARGS` from the repo's root; the finished process."""
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def demo_head(tmp_path: Path, lines: int) -> Path:
    """A jsonl file of the demo set's first `lines` conversations."""
    data = tmp_path / "small.jsonl"
    with open(DEMO, encoding="utf-8") as source:
        data.write_text("".join(line for _, line in zip(range(lines), source)), encoding="utf-8")
    return data
