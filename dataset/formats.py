"""Parse one jsonl line of SFT data into a normalized list of ``{"role", "content"}`` messages.

Accepted line formats (all normalized to roles ``system`` / ``user`` / ``assistant``):

* MiniMind: ``{"conversations": [{"role": "user", "content": "..."}, ...]}``
* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``
* OpenAI:   ``{"messages": [{"role": "user", "content": "..."}, ...]}``

Other top-level keys (e.g. ``task``) and other message keys are ignored.
"""

from __future__ import annotations

import json

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}


class DataError(ValueError):
    """Bad SFT data or tokenizer; the message is one line naming the file (and line) and the problem."""


class LineError(ValueError):
    """A problem with one line; the caller adds the file name and line number."""


def parse_conversation(line: str) -> list[dict[str, str]]:
    """Return the messages of one jsonl line, or raise ``LineError`` describing what is wrong."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LineError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise LineError(f"expected a JSON object, got {type(row).__name__}")
    if "conversations" in row:
        key = "conversations"
    elif "messages" in row:
        key = "messages"
    else:
        raise LineError("missing 'conversations' or 'messages' key")
    raw_messages = row[key]
    if not isinstance(raw_messages, list):
        raise LineError(f"'{key}' must be a list, got {type(raw_messages).__name__}")
    if not raw_messages:
        raise LineError("empty conversation")
    return [_parse_message(message, number) for number, message in enumerate(raw_messages, start=1)]


def _parse_message(message: object, number: int) -> dict[str, str]:
    """Normalize one message (``number`` counts from 1, for error messages)."""
    where = f"message {number}"
    if not isinstance(message, dict):
        raise LineError(f"{where} must be a JSON object, got {type(message).__name__}")
    role_key, content_key = ("from", "value") if "from" in message else ("role", "content")
    if role_key not in message:
        raise LineError(f"{where} has no 'role'")
    role = message[role_key]
    if not isinstance(role, str):
        raise LineError(f"{where} has a non-string {role_key!r}: {role!r}")
    if role not in ROLE_ALIASES:
        raise LineError(f"{where} has unknown role {role!r}")
    if content_key not in message or message[content_key] is None:
        raise LineError(f"{where} has no {content_key!r}")
    content = message[content_key]
    if not isinstance(content, str):
        raise LineError(f"{where} has a non-string {content_key!r} ({type(content).__name__})")
    return {"role": ROLE_ALIASES[role], "content": content}
