"""Read tool calls out of generated assistant text, and compare them with reference calls.

The shipped chat template (MiniMind's layout) renders an assistant turn as::

    <think>\\n{reasoning}\\n</think>\\n\\n{reply}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>...

``parse_reply`` splits generated text (what follows the generation prompt, which may already hold
the opening ``<think>``) into reasoning, reply and calls. After a prompt whose think block is closed
already (``prompt_closes_think``: the shipped template's generation prompt, thinking off, ends with
``<think>\\n\\n</think>\\n\\n``) all of the text is the answer: a ``</think>`` the model writes
there is answer text, and what precedes it is no reasoning. A call block left unclosed at the end
(generation stopped) is a call where its JSON is whole and a malformed one where it was cut
(``call_blocks``). A call is right when its name is equal
and its arguments are JSON-equal to the reference (``calls_match``: ``1`` equals ``1.0`` but not
``true``; the order of parallel calls does not matter). Used by ``scripts/eval_sft.py`` and
``scripts/chat.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .formats import THINK_CLOSE, THINK_OPEN, loads

TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
PROBE = "\ue000"  # a private-use character no template emits: marks where the user's text ends


@dataclass
class Reply:
    reasoning: str
    content: str
    calls: list[dict] = field(default_factory=list)  # {"name": str, "arguments": dict}
    bad_calls: list[str] = field(default_factory=list)  # call blocks that are not a JSON {name, arguments}


def parse_call(block: str) -> dict | None:
    """``{"name", "arguments"}`` from the JSON inside one ``<tool_call>`` block, or ``None`` where
    it is not JSON as a data line must be (``dataset.formats.loads``: a key twice in one object,
    ``NaN``) or not a call."""
    try:
        value = loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": arguments}


def prompt_closes_think(tokenizer) -> bool:
    """Whether the chat template's generation prompt ends with a closed think block (its last
    ``</think>`` after its last ``<think>``), so that the model's text after it is all answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROBE}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = text[text.rindex(PROBE) + len(PROBE):]
    return prompt.rfind(THINK_CLOSE) > prompt.rfind(THINK_OPEN)


def call_blocks(text: str) -> list[str]:
    """The text inside each ``<tool_call>`` block of ``text``. The last one may be unclosed: generation
    stopped (at the end-of-turn token, or at the token limit) before its ``</tool_call>`` or inside
    it; what of the tag was written is left out, so that its JSON is read as a call where it is whole,
    and as a malformed call where the stop cut it."""
    blocks = []
    for match in TOOL_CALL_RE.finditer(text):
        block = match.group(1)
        if not match.group(0).endswith(TOOL_CALL_CLOSE):
            cut = next((size for size in range(len(TOOL_CALL_CLOSE) - 1, 0, -1)
                        if block.endswith(TOOL_CALL_CLOSE[:size])), 0)
            block = block[:len(block) - cut].rstrip()
        blocks.append(block)
    return blocks


def parse_reply(text: str, think_closed: bool = False) -> Reply:
    """Split generated assistant text into reasoning, reply text and tool calls; with
    ``think_closed`` (the prompt closed the think block) all of it is reply and calls."""
    reasoning = ""
    if not think_closed and THINK_CLOSE in text:
        head, _, text = text.partition(THINK_CLOSE)
        reasoning = head.split(THINK_OPEN)[-1].strip("\n")
    elif not think_closed and text.lstrip().startswith(THINK_OPEN):  # an unclosed think block: all reasoning
        return Reply(text.lstrip()[len(THINK_OPEN):].strip("\n"), "")
    reply = Reply(reasoning, "")
    first = text.find("<tool_call>")
    reply.content = (text if first < 0 else text[:first]).strip()
    if first >= 0:
        for block in call_blocks(text[first:]):
            call = parse_call(block)
            if call is None:
                reply.bad_calls.append(block)
            else:
                reply.calls.append(call)
    return reply


def json_kind(value) -> str:
    """The JSON type of a parsed value: a bool is not a number (in Python ``True == 1``)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def json_equal(first, second) -> bool:
    """Equal as JSON values: numbers by value (``1 == 1.0``), a bool only to the same bool, arrays item
    by item, objects key by key, at any depth (walked with a stack: no recursion limit)."""
    pending = [(first, second)]
    while pending:
        a, b = pending.pop()
        if json_kind(a) != json_kind(b):
            return False
        if isinstance(a, dict):
            if a.keys() != b.keys():
                return False
            pending.extend((a[key], b[key]) for key in a)
        elif isinstance(a, list):
            if len(a) != len(b):
                return False
            pending.extend(zip(a, b))
        elif a != b:
            return False
    return True


def calls_match(predicted: list[dict], reference: list[dict]) -> bool:
    """Same calls (name equal, arguments ``json_equal``: ``1 == 1.0``, ``true != 1``), in any order."""
    if len(predicted) != len(reference):
        return False
    unmatched = list(reference)
    for call in predicted:
        found = next((index for index, wanted in enumerate(unmatched) if json_equal(call, wanted)), None)
        if found is None:
            return False
        del unmatched[found]
    return True
