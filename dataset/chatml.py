"""The ChatML layout of this repo's and MiniMind's chat templates, rendered in Python.

The general path (``rendering.loss_spans``) renders a conversation through the tokenizer's Jinja
template several times per assistant turn to locate the loss spans of any template: correct for
every template, and most of the cost of a build. The templates people train with here are the
ChatML family in MiniMind's text layout (the shipped ``model/tokenizer`` template and MiniMind's
own, which render training conversations to the same text): ``<|im_start|>role\\n...<|im_end|>\\n``,
tools in the system turn, every assistant turn with a think block, tool calls as
``<tool_call>`` JSON, consecutive tool results in one user turn. ``render`` writes that text
directly, and each assistant turn's loss span with it: from the end of ``<|im_start|>assistant\\n``
to the end of its ``<|im_end|>`` (think block, reply, tool calls, end-of-turn token), the spans the
general path locates.

It is used only for a tokenizer whose template gives the same text and the same spans as the
general path on every conversation of ``PROBES`` (``matches_template``: they take every branch of
the layout: system or not, tools or not, reasoning as a field, as empty, as a think block in the
content, tool calls with object and string arguments, with and without text, consecutive tool
results, a system turn after the first, newlines around every part, JSON that needs escaping);
any other template (Qwen3's, which drops earlier think blocks; other layouts) keeps the general
path. ``tests/dataset/test_fast_path.py`` compares both paths token for token and mask for mask
on the whole demo set and on random conversations.
"""

from __future__ import annotations

import json

from .formats import THINK_CLOSE, THINK_OPEN, Conversation
from .rendering import loss_spans

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ASSISTANT_HEADER = IM_START + "assistant\n"
TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
              "<args-json-object>}\n</tool_call>" + IM_END + "\n")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # the templates' ``tojson`` (transformers' filter)


def _assistant(message: dict) -> str:
    """An assistant turn after its header: think block, reply, tool calls, ``<|im_end|>``."""
    text = message.get("content")
    text = text if isinstance(text, str) else ""
    thought = message.get("reasoning_content")
    if not isinstance(thought, str):
        if THINK_CLOSE in text:
            thought = text.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
            text = text.split(THINK_CLOSE)[-1].lstrip("\n")
        else:
            thought = ""
    parts = [THINK_OPEN, "\n", thought.strip("\n"), "\n", THINK_CLOSE, "\n\n", text.lstrip("\n")]
    for number, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or call
        if number or text:
            parts.append("\n")
        arguments = function["arguments"]
        parts += ['<tool_call>\n{"name": "', function["name"], '", "arguments": ',
                  arguments if isinstance(arguments, str) else _json(arguments), "}\n</tool_call>"]
    parts.append(IM_END)
    return "".join(parts)


def render(conversation: Conversation) -> tuple[str, list[tuple[int, int]], int] | None:
    """(text, loss spans, end of the system turn's ``<|im_end|>`` or 0) of the conversation in the
    layout, or ``None`` where the general path must decide (an assistant turn first: that is the
    line's error there)."""
    messages, tools = conversation.messages, conversation.tools
    if not messages or messages[0]["role"] == "assistant":
        return None
    parts: list[str] = []
    first_is_system = messages[0]["role"] == "system"
    if tools:
        parts.append(IM_START + "system\n")
        if first_is_system:
            parts.append(messages[0]["content"] + "\n\n")
        parts.append(TOOLS_HEAD)
        parts += ["\n" + _json(tool) for tool in tools]
        parts.append(TOOLS_TAIL)
    elif first_is_system:
        parts.append(IM_START + "system\n" + messages[0]["content"] + IM_END + "\n")
    position = sum(map(len, parts))
    head = position - 1 if parts else 0
    spans = []
    last = len(messages) - 1
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "user" or (role == "system" and index):
            piece = IM_START + role + "\n" + message["content"] + IM_END + "\n"
        elif role == "assistant":
            body = _assistant(message)
            start = position + len(ASSISTANT_HEADER)
            spans.append((start, start + len(body)))
            piece = ASSISTANT_HEADER + body + "\n"
        elif role == "tool":
            piece = ""
            if index == 0 or messages[index - 1]["role"] != "tool":
                piece = IM_START + "user"
            piece += "\n<tool_response>\n" + message["content"] + "\n</tool_response>"
            if index == last or messages[index + 1]["role"] != "tool":
                piece += IM_END + "\n"
        else:
            continue
        parts.append(piece)
        position += len(piece)
    return "".join(parts), spans, head


def _probe_conversations() -> list[Conversation]:
    """Conversations that take every branch of the layout (see the module docstring)."""
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look \"it\" up: <b>&amp;</b> 中文\n",
                                                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "add", "parameters": {"a": 1.5, "b": [1, None, True, False]}}}]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "Zorlia \"x\" 中", "n": 2, "f": 0.5}}}
    raw_call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1,"b":2}'}}
    user = {"role": "user", "content": "\nQ? \n"}
    return [
        Conversation([user, {"role": "assistant", "content": "A"}]),
        Conversation([{"role": "system", "content": "Be terse.\n"}, user, {"role": "assistant", "content": "\n\nA\n"}]),
        Conversation([{"role": "system", "content": "S"}, user,
                      {"role": "assistant", "content": "", "reasoning_content": "\nthink \n", "tool_calls": [call, raw_call]},
                      {"role": "tool", "content": "{\"r\": 1}", "name": "lookup"}, {"role": "tool", "content": "\n2\n"},
                      {"role": "assistant", "content": "It is 3.", "tool_calls": [call]},
                      {"role": "tool", "content": "r"}, {"role": "user", "content": "And?"},
                      {"role": "assistant", "content": "B", "reasoning_content": ""}], tools),
        Conversation([user, {"role": "assistant", "content": "x", "tool_calls": [raw_call]}, {"role": "tool", "content": ""},
                      {"role": "system", "content": "later system"}, {"role": "assistant", "content": "done"}], tools[:1]),
        Conversation([user, {"role": "assistant", "content": "a <think>b</think>\n\nc", "reasoning_content": ""},
                      {"role": "user", "content": "<think>"}, {"role": "assistant", "content": "\n<think>\nr\n</think>\n\nc"},
                      {"role": "user", "content": ""}, {"role": "assistant", "content": "", "reasoning_content": "R"},
                      {"role": "user", "content": "u"}, {"role": "assistant", "content": "<think>r</think>\n\n", "tool_calls": [call]}],
                     tools[1:]),
        Conversation([{"role": "tool", "content": "first"}, {"role": "tool", "content": "second"},
                      {"role": "assistant", "content": "ok"}, {"role": "system", "content": ""},
                      {"role": "assistant", "content": "again"}]),
        Conversation([{"role": "system", "content": ""}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "v"}, {"role": "assistant", "content": "w"}]),
    ]


PROBES = _probe_conversations()
_MATCHES: dict[str, bool] = {}  # chat template -> does the layout reproduce it


def matches_template(tokenizer) -> bool:
    """True if the tokenizer's template renders every probe conversation to the layout's text and
    the general path locates the layout's spans in it (remembered per template)."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return False
    if template not in _MATCHES:
        try:
            _MATCHES[template] = all(loss_spans(tokenizer, probe) == render(probe)[:2] for probe in PROBES)
        except Exception:  # noqa: BLE001 - a template that rejects a probe is not this layout
            _MATCHES[template] = False
    return _MATCHES[template]
