"""Conversations and data files the dataset tests build token caches from: a chat with a system
prompt, a tool conversation with reasoning (MiniMind's format), numbered one-question chats, a row
that holds a key twice, and writers of jsonl (and .jsonl.gz) files."""

import gzip
import json
from pathlib import Path


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "佐利亚的首都是哪里？"},
    {"role": "assistant", "content": "维尔姆"},
]
EMPTY_THINK = "<think>\n\n</think>\n\n"  # the shipped template's think block of a reply without reasoning

TOOLS = [{"type": "function", "function": {"name": "lookup_country", "description": "Look up a fact.",
                                           "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}]
CALL = {"name": "lookup_country", "arguments": {"country": "Zorlia", "field": "capital"}}
RESULT = '{"country": "Zorlia", "capital": "Velm"}'
CALL_TEXT = '<tool_call>\n{"name": "lookup_country", "arguments": {"country": "Zorlia", "field": "capital"}}\n</tool_call>'
TOOL_CHAT_MINIMIND = {"conversations": [
    {"role": "system", "content": "You are terse.", "tools": json.dumps(TOOLS)},
    {"role": "user", "content": "Capital of Zorlia?"},
    {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": json.dumps([CALL])},
    {"role": "tool", "content": RESULT},
    {"role": "assistant", "content": "Velm"},
]}

# A row holding a key twice in one JSON object (a bad line), and the row the rules of rows version 1
# read in it: the key's last value (dataset.cache.key.ROWS_CHANGES).
KEY_TWICE = ('{"messages": [{"role": "user", "content": "Capital of Zorlia?", "content": "Capital of Quendor?"}, '
             '{"role": "assistant", "content": "Velm"}]}')
KEY_TWICE_READ_AS_LAST_VALUE = {"messages": [{"role": "user", "content": "Capital of Quendor?"},
                                             {"role": "assistant", "content": "Velm"}]}


def write_lines(path: Path, rows) -> Path:
    """Write rows (dicts become JSON, strings are written verbatim) one per line."""
    lines = [row if isinstance(row, str) else json.dumps(row, ensure_ascii=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_chat(i: int) -> dict:
    return {"conversations": [{"role": "user", "content": f"What is {i} plus 1?"}, {"role": "assistant", "content": str(i + 1)}]}


def chat_line(i: int) -> str:
    return json.dumps(make_chat(i))


def write_rows(path: Path, lines: list[str]) -> Path:
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
