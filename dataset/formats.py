"""Parse one jsonl line of SFT data into a conversation: messages plus the tools it may call.

Accepted line formats, all normalized to the same ``Conversation``:

* MiniMind: ``{"conversations": [{"role": ..., "content": ...}, ...]}``; ``tools`` on the system
  message (a JSON string or a list), ``reasoning_content`` and ``tool_calls`` on assistant
  messages, ``role: "tool"`` results.
* OpenAI:   ``{"messages": [...], "tools": [...]}``; ``tool_calls`` as
  ``[{"type": "function", "function": {"name", "arguments"}}]``; content may be a list of text
  parts; assistant content may be ``null`` beside tool calls.
* ShareGPT: ``{"conversations": [{"from": "human", "value": ...}, ...], "system": ..., "tools": ...}``
  with ``function_call`` turns (a JSON call or list of calls; merged into the assistant turn they
  follow) and ``observation`` turns (tool results).

Normalized messages: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``; assistant
messages may add ``reasoning_content`` (non-empty str, also split out of a leading
``<think>...</think>`` block of the content; ``""`` when the content keeps a ``</think>`` as text,
see ``_split_think``) and ``tool_calls`` (OpenAI form, ``arguments`` always a JSON object); tool
messages may add ``name`` / ``tool_call_id``. Nothing the data carries is dropped silently: a
message key we would not render is an error (``LineError``), unless its value is empty/null or it
is metadata (``id``; a tool message's ``name`` and ``tool_call_id``, handed to the template, which
may pair results with calls by order instead, as the shipped one does). A line holds one conversation and a tool call one form: both
``conversations`` and ``messages`` in a line, or a call's flat ``name``/``arguments`` beside its
nested ``function``, is an error, since either could be the one meant (a null or empty one counts
as absent, as pandas and HF exports write a key a row lacks). A tool call is rendered as
a function call: a ``type`` other than ``"function"``, or a key inside its ``function`` other
than ``name``, ``arguments`` and ``id`` (a ``type`` or ``function`` there), is an error. A
non-empty top-level ``functions`` (OpenAI's legacy name for tool definitions, entries without the
``{"type": "function", "function": ...}`` wrapper of ``tools``) is an error too: its definitions
would not be rendered, and taking them as ``tools`` would render other text than the same
definitions given in ``tools``. Top-level keys other than the conversation, ``tools`` and
``system`` (e.g. ``task``, ``id``) are metadata and ignored.

Lines (and JSON strings inside them: ``tools``, tool-call ``arguments``) must be JSON: ``NaN``,
``Infinity`` and numbers beyond the float range, which Python's ``json`` would accept, make the
line bad (``loads``); so does a key given twice in one JSON object, at any depth, which Python's
``json`` reads as its last value, dropping the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_call": "function_call",  # ShareGPT: an assistant turn that calls tools
}
METADATA_KEYS = {"id"}  # message and tool-call keys that carry no content; ignored
FUNCTION_KEYS = ("name", "arguments")  # what a tool call's function is read from
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The top-level keys a row is read from, and 'functions', read to refuse it (see the module docstring).
ROW_KEYS = ("conversations", "messages", "tools", "system", "functions")
# A line ``sources`` yields for a row it cannot turn into JSON (a parquet timestamp, ...): the
# marker, then the problem. No JSON text starts with a NUL, so no data line can look like it.
ROW_PROBLEM = "\x00row problem: "


class DataError(ValueError):
    """Bad SFT data or tokenizer; the message is one line naming the file (and line) and the problem."""


class LineError(ValueError):
    """A problem with one line; the caller adds the file name and line number."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first non-empty line of `error`'s message (at most `limit` characters), else its type:
    a library's exception as part of one of our one-line errors. A first line that only introduces
    the next (it ends with ':', as transformers' config validation and torch's load_state_dict
    write theirs) comes with that next line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:limit]


@dataclass
class Conversation:
    messages: list[dict]
    tools: list | None = None

    def to_json(self) -> dict:
        """A MiniMind-schema-independent row (OpenAI style) that parses back to this conversation."""
        row: dict = {"messages": self.messages}
        if self.tools:
            row["tools"] = self.tools
        return row


class _NotJSON(ValueError):
    """What Python's ``json`` accepts but a line must not hold: a value JSON does not have (``NaN``,
    ``Infinity``, ``1e999``), or a key twice in one object (JSON's names SHOULD be unique; readers
    differ in which value they keep)."""


def _reject_constant(name: str):
    raise _NotJSON(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotJSON(f"the number {text} is out of range (it would be read as infinity)")
    return value


def repeated_key(keys):
    """The first of ``keys`` that an earlier one equals, else ``None``."""
    seen = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    return None


def _unique_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict, or ``_NotJSON`` naming a key they hold twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _NotJSON(f"duplicate key {repeated_key(key for key, _ in pairs)!r} in one JSON object")
    return obj


_HOOKS = {"parse_constant": _reject_constant, "parse_float": _finite_float, "object_pairs_hook": _unique_keys}
_DECODER = json.JSONDecoder(**_HOOKS)


def loads(text: str):
    """``json.loads`` that accepts only JSON: ``NaN``, ``Infinity`` and numbers beyond the float
    range raise ``ValueError`` (``_NotJSON``) instead of becoming floats that are not JSON, and so
    does an object holding a key twice (at any depth) instead of keeping its last value.

    One decoder for every call (``json.loads`` with hooks builds a new one each time); what
    ``json.loads`` checks before decoding a ``str`` (a leading byte order mark) still goes through it."""
    if isinstance(text, str) and not text.startswith("\ufeff"):
        return _DECODER.decode(text)
    return json.loads(text, **_HOOKS)


def decode_line(raw: bytes) -> str:
    """A raw data line as text, or ``LineError`` naming the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LineError(f"invalid UTF-8 at byte {error.start}") from None


def parse_line(line: str) -> Conversation:
    """Parse one jsonl line, or raise ``LineError`` describing what is wrong."""
    return parse_row(load_row(line))


def load_row(line: str) -> dict:
    """The JSON object of one jsonl line (a leading byte order mark ignored), or ``LineError``."""
    if line.startswith(ROW_PROBLEM):
        raise LineError(line[len(ROW_PROBLEM):].strip())
    if line.startswith("\ufeff"):  # a UTF-8 byte order mark (first line of some exported files)
        line = line[1:]
        if not line.strip():
            raise LineError("a UTF-8 byte order mark alone on the line, no JSON (delete the line)")
    try:
        row = loads(line)
    except json.JSONDecodeError as exc:
        raise LineError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # NaN, Infinity, 1e999, a key twice (``_NotJSON``); an integer of over 4300 digits
        raise LineError(f"invalid JSON ({exc})") from None
    except RecursionError:
        raise LineError("JSON nested too deeply") from None
    if not isinstance(row, dict):
        hint = " (a JSON array file must be converted to JSON Lines: one conversation object per line)" if isinstance(row, list) else ""
        raise LineError(f"expected a JSON object, got {type(row).__name__}{hint}")
    return row


def parse_row(row: dict) -> Conversation:
    """Normalize one decoded row (see the module docstring)."""
    given = [key for key in ("conversations", "messages") if key in row]
    if len(given) == 2:  # one of them empty or null (a pandas or HF export of mixed rows) carries nothing
        filled = [key for key in given if not _is_empty(row[key])]
        if len(filled) == 2:
            raise LineError("the line has both 'conversations' and 'messages'; keep one of them "
                            "(a line holds one conversation)")
        given = filled or given[:1]
    if not given:
        raise LineError("missing 'conversations' or 'messages' key")
    key = given[0]
    raw_messages = row[key]
    if not isinstance(raw_messages, list):
        raise LineError(f"'{key}' must be a list, got {type(raw_messages).__name__}")
    if not raw_messages:
        raise LineError("empty conversation")
    if not _is_empty(row.get("functions")):
        raise LineError("top-level 'functions' (OpenAI's legacy name for tool definitions) is not read; put the "
                        """definitions in 'tools', each as {"type": "function", "function": {...}}""")
    tools = _parse_tools(row.get("tools"), "'tools'")
    messages: list[dict] = []
    system = row.get("system")
    if system not in (None, ""):
        if not isinstance(system, str):
            raise LineError(f"top-level 'system' must be a string, got {type(system).__name__}")
        messages.append({"role": "system", "content": system})
    for number, raw in enumerate(raw_messages, start=1):
        message, message_tools = _parse_message(raw, number)
        if message_tools is not None:
            if tools is not None:
                raise LineError(f"message {number} has 'tools' but the line already gave tools")
            tools = message_tools
        if message["role"] == "function_call":
            _merge_tool_calls(messages, message, number)
        elif message["role"] == "system" and system:
            raise LineError(f"message {number} is a system message but the line already has a top-level 'system'")
        else:
            messages.append(message)
    _check_validity(messages)
    return Conversation(messages, tools)


def _merge_tool_calls(messages: list[dict], call_message: dict, number: int) -> None:
    """A ShareGPT ``function_call`` turn continues the assistant turn before it, or starts one."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).extend(call_message["tool_calls"])
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": call_message["tool_calls"]})


def _check_validity(messages: list[dict]) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise LineError("conversation has no assistant message (nothing to learn from)")


def _is_empty(value) -> bool:
    return value is None or value == "" or value == [] or value == {}


def _parse_message(message: object, number: int) -> tuple[dict, list | None]:
    """Normalize one message; also return the tools it declares (``None`` if none)."""
    where = f"message {number}"
    if not isinstance(message, dict):
        raise LineError(f"{where} must be a JSON object, got {type(message).__name__}")
    sharegpt = "from" in message
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if role_key not in message:
        raise LineError(f"{where} has no 'role'")
    raw_role = message[role_key]
    if not isinstance(raw_role, str):
        raise LineError(f"{where} has a non-string {role_key!r}: {raw_role!r}")
    if raw_role not in ROLE_ALIASES:
        raise LineError(f"{where} has unknown role {raw_role!r}")
    role = ROLE_ALIASES[raw_role]
    allowed = {role_key, content_key} | METADATA_KEYS
    out: dict = {"role": role}

    if role == "function_call":
        out["tool_calls"] = _parse_sharegpt_calls(message.get(content_key), where)
        _check_unknown_keys(message, allowed, where)
        return out, None

    has_calls = role == "assistant" and not _is_empty(message.get("tool_calls"))
    content = message.get(content_key)
    if content is None:
        if not has_calls:
            raise LineError(f"{where} has no {content_key!r}")
        content = ""
    out["content"] = _text(content, where, content_key)

    tools = None
    if role == "system":
        allowed.add("tools")
        tools = _parse_tools(message.get("tools"), f"{where} 'tools'")
    elif role == "assistant":
        allowed |= {"reasoning_content", "tool_calls"}
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise LineError(f"{where} has a non-string 'reasoning_content' ({type(reasoning).__name__})")
        out["content"], reasoning = _split_think(out["content"], reasoning or "", where)
        if reasoning.strip("\n"):
            out["reasoning_content"] = reasoning.strip("\n")
        elif THINK_CLOSE in out["content"]:
            # Kept as text: an empty reasoning tells templates (this repo's, Qwen3's) that split
            # content at '</think>' when a message has no reasoning_content to leave it alone.
            out["reasoning_content"] = ""
        if has_calls:
            out["tool_calls"] = _parse_tool_calls(message["tool_calls"], where)
    elif role == "tool":
        allowed |= {"name", "tool_call_id"}
        for key in ("name", "tool_call_id"):
            if not _is_empty(message.get(key)):
                if not isinstance(message[key], str):
                    raise LineError(f"{where} has a non-string {key!r}")
                out[key] = message[key]
    _check_unknown_keys(message, allowed, where)
    return out, tools


def _split_think(content: str, reasoning: str, where: str) -> tuple[str, str]:
    """(content, reasoning) of an assistant message: a LEADING think block of the content
    (optional whitespace, ``<think>``, up to the first ``</think>``) is its reasoning; think tags
    anywhere else are text and kept as they are. Ambiguous tags are the line's error: a think
    block at the start beside a ``reasoning_content``, a ``<think>`` at the start never closed,
    and a ``</think>`` with no ``<think>`` before it (data whose ``<think>`` was in the prompt)."""
    stripped = content.lstrip()
    if stripped.startswith(THINK_OPEN):
        if reasoning.strip("\n"):
            raise LineError(f"{where} has both 'reasoning_content' and a <think> block at the start of its content; "
                            "keep one of them")
        if THINK_CLOSE not in stripped:
            raise LineError(f"{where} content starts with <think> but has no </think>; close the think block")
        head, _, content = stripped[len(THINK_OPEN):].partition(THINK_CLOSE)
        reasoning, content = head.strip("\n"), content.lstrip("\n")
    close = content.find(THINK_CLOSE)
    if close >= 0 and THINK_OPEN not in content[:close]:
        raise LineError(
            f"{where} content has a </think> without a <think> before it (the reasoning's opening tag missing?); "
            "put the reasoning in 'reasoning_content' or start the content with <think>"
        )
    return content, reasoning


def _check_unknown_keys(message: dict, allowed: set, where: str) -> None:
    for key, value in message.items():
        if key not in allowed and not _is_empty(value):
            raise LineError(
                f"{where} ({message.get('role', message.get('from'))}) has a key {key!r} that would not be "
                "rendered; remove it from the data (it is never dropped silently)"
            )


def _text(content, where: str, key: str) -> str:
    """A string, or the concatenated text of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise LineError(f"{where} {key!r} has a content part of type {kind!r} (only text can be trained on)")
        return "".join(texts)
    raise LineError(f"{where} has a non-string {key!r} ({type(content).__name__})")


def _json_value(value, where: str):
    """``value`` itself, or the JSON it encodes if it is a string."""
    if isinstance(value, str):
        try:
            return loads(value)
        except json.JSONDecodeError as exc:
            raise LineError(f"{where} is a string but not valid JSON ({exc.msg})") from None
        except ValueError as exc:
            raise LineError(f"{where} is a string but not valid JSON ({exc})") from None
        except RecursionError:
            raise LineError(f"{where} is a string of JSON nested too deeply") from None
    return value


def _parse_tools(value, where: str) -> list | None:
    if _is_empty(value):
        return None
    tools = _json_value(value, where)
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise LineError(f"{where} must be a list of JSON objects (or a JSON string of one)")
    return tools or None


def _parse_tool_calls(value, where: str) -> list[dict]:
    calls = _json_value(value, f"{where} 'tool_calls'")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise LineError(f"{where} 'tool_calls' must be a list")
    return [_normalize_call(call, f"{where} tool call {k}") for k, call in enumerate(calls, start=1)]


def _parse_sharegpt_calls(value, where: str) -> list[dict]:
    if _is_empty(value):
        raise LineError(f"{where} (function_call) has no 'value'")
    return _parse_tool_calls(value, where)


def _normalize_call(call, where: str) -> dict:
    """Flat ``{name, arguments}`` or nested ``{type, function: {name, arguments}}`` -> nested, arguments an object.

    A call in both forms is an error, even when they agree: which one is meant is not guessed. A
    ``type`` other than ``"function"`` is an error, as the call would be rendered as a function call;
    so is a key inside ``function`` other than ``name``, ``arguments`` and metadata (``id``): a
    ``type`` or ``function`` there is not read. A key whose value is empty or null carries nothing
    and counts as absent (pandas and HF exports write null where a row lacks a struct field)."""
    if not isinstance(call, dict):
        raise LineError(f"{where} must be a JSON object")
    call = {key: value for key, value in call.items() if not _is_empty(value)}  # empty or null: carries nothing
    flat = [key for key in FUNCTION_KEYS if key in call]
    if flat and "function" in call:
        raise LineError(f"{where} has {' and '.join(map(repr, flat))} beside a nested 'function'; give the call in "
                        "one form, flat or nested (both are refused, even when they agree)")
    kind = call.get("type")
    if kind is not None and kind != "function":
        raise LineError(f"{where} has type {kind!r}, not 'function' (only function calls are rendered)")
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise LineError(f"{where} 'function' must be a JSON object")
    if function is not call:
        unread = {key for key, value in function.items() if not _is_empty(value)} - set(FUNCTION_KEYS) - METADATA_KEYS
        if unread:
            raise LineError(f"{where} 'function' has key(s) {sorted(unread)} that would not be rendered; inside "
                            "'function' only 'name' and 'arguments' are read")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise LineError(f"{where} has no function name")
    arguments = function.get("arguments", {})
    arguments = _json_value(arguments, f"{where} 'arguments'") if arguments != "" else {}
    if not isinstance(arguments, dict):
        raise LineError(f"{where} 'arguments' must be a JSON object")
    unknown = set(call) - set(FUNCTION_KEYS) - {"type", "function"} - METADATA_KEYS
    if unknown:
        raise LineError(f"{where} has key(s) {sorted(unknown)} that would not be rendered")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
