"""Which part of a conversation each token comes from: its segments, for ``scripts/inspect_data.py``.

The tokens training keeps and their loss mask come from the seam training uses
(``tokens.encode_conversation``); the whole rendering (``rendering.loss_spans``: the text and each
assistant turn's loss span; ``rendering.tokenize_rendered``: all its tokens and their character
offsets, also past ``max_seq_len``) gives each token its place in the text.
Every character of that text then gets a segment:

* ``system``, ``user``, ``tool result``: the message's content, found in the text in order;
* ``tools block``: what the template adds for ``tools=`` (the text that rendering without tools
  does not have: one more render, for rows with tools only);
* each assistant loss span splits into ``think block`` (``<think>`` to ``</think>`` and the
  newlines after it), ``reply`` (up to the end of the message's content), ``tool call`` (what
  follows the reply when the message calls tools) and ``end-of-turn`` (the special token that ends
  the span, ``<|im_end|>``);
* ``template``: everything else the template writes (turn headers, ``<|im_end|>`` of turns that
  carry no loss, newlines between turns).

A token's segment is that of its middle character (the one holding most of it when it crosses a
boundary). ``SegmentedRow.pieces`` cuts the text into one contiguous piece per token, so the
pieces join back to the text (a character that several byte-level tokens share goes to the
first; the others get an empty piece).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..formats import THINK_CLOSE, THINK_OPEN, Conversation
from ..rendering import loss_spans, render, span_mask, special_token_texts, tokenize_rendered
from ..tokens import encode_conversation

SEGMENTS = ("system", "tools block", "user", "tool result", "think block", "reply", "tool call", "end-of-turn",
            "template")
SYSTEM, TOOLS, USER, TOOL_RESULT, THINK, REPLY, TOOL_CALL, END, TEMPLATE = range(len(SEGMENTS))
CONTENT_SEGMENTS = {"system": SYSTEM, "user": USER, "tool": TOOL_RESULT}


@dataclass
class SegmentedRow:
    """One conversation as trained: all its tokens (before truncation), their loss mask and segments."""

    text: str
    ids: np.ndarray  # int64 (n,), the whole rendering; training keeps the first max_seq_len
    offsets: np.ndarray  # int64 (n, 2), character offsets in ``text``
    supervised: np.ndarray  # bool (n,), training's loss mask (and its continuation past the cut)
    segments: np.ndarray  # int8 (n,), an index into SEGMENTS
    max_seq_len: int
    empty_thinks: list[tuple[int, int]] = field(default_factory=list)  # token ranges of empty think blocks
    assistant_turns: int = 0
    turns: list[tuple[int, int]] = field(default_factory=list)  # token ranges of the assistant turns' loss spans
    thoughts: int = 0  # think blocks with reasoning in them

    @property
    def kept(self) -> int:
        """Tokens training keeps (the first ``max_seq_len``)."""
        return min(len(self.ids), self.max_seq_len)

    @property
    def truncated(self) -> bool:
        return len(self.ids) > self.max_seq_len

    @property
    def dropped(self) -> bool:
        """No supervised token survives truncation: training drops the row."""
        return not self.supervised[: self.max_seq_len].any()

    def counts(self, supervised_only: bool = False, kept: bool = True) -> np.ndarray:
        """Tokens per segment (int64, len(SEGMENTS)): of the kept tokens (or of the cut ones)."""
        window = slice(0, self.kept) if kept else slice(self.kept, None)
        segments = self.segments[window]
        if supervised_only:
            segments = segments[self.supervised[window]]
        return np.bincount(segments, minlength=len(SEGMENTS)).astype(np.int64)

    def supervised_empty_thinks(self) -> tuple[int, int]:
        """(empty think blocks ``<think>\\n\\n</think>\\n\\n`` that carry loss within ``max_seq_len``,
        their supervised tokens)."""
        tokens = [int(self.supervised[start:min(end, self.kept)].sum()) for start, end in self.empty_thinks]
        return sum(map(bool, tokens)), sum(tokens)

    def trained_turns(self) -> int:
        """Assistant turns with a supervised token within ``max_seq_len`` (none in a dropped row)."""
        return sum(bool(self.supervised[start:min(end, self.kept)].any()) for start, end in self.turns)

    def drop_reason(self) -> tuple[str, str] | None:
        """``None`` for a kept row; else (reason, detail with the numbers) of why no loss token is left."""
        if not self.dropped:
            return None
        if not self.supervised.any():
            return "no assistant turn carries loss", f"{len(self.ids)} tokens, none supervised"
        first = int(np.flatnonzero(self.supervised)[0])
        before = np.bincount(self.segments[:first], minlength=len(SEGMENTS))
        largest = int(before.argmax())
        detail = f"the first supervised token is token {first + 1}; before it: " + ", ".join(
            f"{SEGMENTS[k]} {int(before[k])}" for k in np.argsort(-before, kind="stable") if before[k])
        if before[largest] >= self.max_seq_len:
            return f"the {SEGMENTS[largest]} alone is longer than --max_seq_len", detail
        return "the prompt before the first assistant turn is longer than --max_seq_len", detail

    def pieces(self) -> list[tuple[int, int]]:
        """(start, end) of each token's piece of ``text``: contiguous, joining back to the whole text."""
        pieces, cursor = [], 0
        for _, end in self.offsets.tolist():
            end = max(cursor, min(end, len(self.text)))
            pieces.append((cursor, end))
            cursor = end
        if pieces and cursor < len(self.text):
            pieces[-1] = (pieces[-1][0], len(self.text))
        return pieces


def segment_row(tokenizer, conversation: Conversation, max_seq_len: int) -> SegmentedRow:
    """Render, tokenize and segment one conversation (``LineError`` as training would raise it)."""
    kept_ids, kept_mask = encode_conversation(tokenizer, conversation, max_seq_len)
    text, spans = loss_spans(tokenizer, conversation)
    ids, offsets = tokenize_rendered(tokenizer, conversation, text)
    ids = np.asarray(ids, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not np.array_equal(ids[: len(kept_ids)], kept_ids):
        raise RuntimeError("the rendering's tokens differ from the tokens training keeps (tokens.encode_conversation)")
    supervised = span_mask(offsets, spans)
    supervised[: len(kept_mask)] = kept_mask
    codes, thinks, turns = character_segments(tokenizer, conversation, text, spans)
    if len(text):
        middle = np.clip((offsets[:, 0] + np.maximum(offsets[:, 1], offsets[:, 0] + 1) - 1) // 2, 0, len(text) - 1)
        segments = codes[middle]
    else:
        segments = np.full(len(ids), TEMPLATE, dtype=np.int8)
    empty_thinks = _token_ranges(offsets, (think[:2] for think in thinks if think[2]))
    return SegmentedRow(text, ids, offsets, supervised, segments.astype(np.int8), max_seq_len, empty_thinks, turns,
                        _token_ranges(offsets, spans), sum(not think[2] for think in thinks))


def _token_ranges(offsets: np.ndarray, character_ranges) -> list[tuple[int, int]]:
    """(first, end) token indices of the tokens overlapping each character range that has any."""
    ranges = []
    for start, end in character_ranges:
        inside = np.flatnonzero((offsets[:, 1] > start) & (offsets[:, 0] < end))
        if len(inside):
            ranges.append((int(inside[0]), int(inside[-1]) + 1))
    return ranges


def character_segments(tokenizer, conversation: Conversation, text: str, spans: list[tuple[int, int]]):
    """(segment code per character of ``text``, think blocks as (start, end, empty), assistant turns)."""
    codes = np.full(len(text), TEMPLATE, dtype=np.int8)
    tools = tools_block(tokenizer, conversation, text)
    if tools:
        codes[tools[0]:tools[1]] = TOOLS
    assistants = [m for m in conversation.messages if m["role"] == "assistant"]
    # loss_spans leaves out a turn whose span is empty; then the spans cannot be paired with turns.
    paired = dict(zip(map(id, assistants), spans)) if len(spans) == len(assistants) else {}
    specials = special_token_texts(tokenizer)
    thinks, cursor = [], 0
    for message in conversation.messages:
        if message["role"] == "assistant":
            span = paired.get(id(message))
            if span is None:
                continue
            think = _mark_assistant(codes, text, span, message, specials)
            if think is not None:
                thinks.append(think)
            cursor = span[1]
        elif message["role"] in CONTENT_SEGMENTS:
            found = _find_content(text, message.get("content") or "", cursor, tools)
            if found is not None:
                codes[found[0]:found[1]] = CONTENT_SEGMENTS[message["role"]]
                cursor = found[1]
    return codes, thinks, len(assistants)


def tools_block(tokenizer, conversation: Conversation, text: str) -> tuple[int, int] | None:
    """Character range of what the template adds for the conversation's tools, or ``None``."""
    if not conversation.tools:
        return None
    try:
        plain = render(tokenizer, Conversation(conversation.messages, None))
    except ValueError:  # a template that needs the tools for these messages
        return None
    prefix = len(os.path.commonprefix([text, plain]))
    suffix = len(os.path.commonprefix([text[prefix:][::-1], plain[prefix:][::-1]]))
    end = len(text) - suffix
    return (prefix, end) if end > prefix else None


def _find_content(text: str, content: str, cursor: int, tools: tuple[int, int] | None) -> tuple[int, int] | None:
    for needle in dict.fromkeys((content, content.strip())):
        if not needle:
            continue
        position = text.find(needle, cursor)
        if tools and tools[0] <= position < tools[1]:  # the same words inside the tools block
            position = text.find(needle, max(cursor, tools[1]))
        if position >= 0:
            return position, position + len(needle)
    return None


def _mark_assistant(codes: np.ndarray, text: str, span: tuple[int, int], message: dict, specials: list[str]):
    """Mark one assistant span's think block, reply, tool calls and end-of-turn; return its think
    block as (start, end, whether it is empty), or ``None``."""
    start, end = span
    body, think = start, None
    if text.startswith(THINK_OPEN, start):
        close = text.find(THINK_CLOSE, start, end)
        if close >= 0:
            body = close + len(THINK_CLOSE)
            while body < end and text[body] in "\r\n":
                body += 1
            codes[start:body] = THINK
            think = (start, body, not text[start + len(THINK_OPEN):close].strip())
    stop = end
    for special in specials:  # longest first
        if text.endswith(special, body, end):
            stop = end - len(special)
            codes[stop:end] = END
            break
    content = (message.get("content") or "").strip()
    found = text.find(content, body, stop) if content else -1
    if not message.get("tool_calls"):
        codes[body:stop] = REPLY
    elif found >= 0:
        codes[body:found + len(content)] = REPLY
        codes[found + len(content):stop] = TOOL_CALL
    else:
        codes[body:stop] = REPLY if content else TOOL_CALL
    return think
