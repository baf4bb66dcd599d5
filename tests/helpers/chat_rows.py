"""Conversations and data files the dataset tests build token caches from."""

import gzip
import json
from pathlib import Path


def chat_line(i: int) -> str:
    return json.dumps({"conversations": [{"role": "user", "content": f"What is {i} plus 1?"},
                                         {"role": "assistant", "content": str(i + 1)}]})


def write_rows(path: Path, lines: list[str]) -> Path:
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
