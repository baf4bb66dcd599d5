"""MiniMind's two SFT augmentations, opt-in and deterministic, applied to cached samples.

* ``system_prompt_ratio``: that fraction of the samples without a system prompt (and without
  tools) gets one of ``SYSTEM_PROMPTS`` in front (MiniMind: 0.2);
* ``drop_empty_think_ratio``: in that fraction of the samples every empty think block
  (``<think>\\n\\n</think>\\n\\n``) of the assistant turns is removed (MiniMind removes them in 80%),
  so the model learns to answer both with and without it. A turn's block is where its loss span
  starts; the same characters inside a reply are its text (``docs/data.md``: think tags after the
  start of the content are trained as written) and stay. A sample whose only loss tokens are such
  blocks keeps them (``_drop``).

Both act on the token ids of the cache, at ``__getitem__`` time, drawn from a generator seeded by
``(seed, epoch, sample index)``: the cache does not depend on them, an epoch sees other draws
than the one before, and a resumed run (or one with another world size) draws exactly what the
uninterrupted run drew. They equal the tokenization of the augmented text where the tokenizer
cuts the text at the edges of the prefix and of the think block (the special tokens bound the
system prefix; with the shipped tokenizer, Qwen2's pre-tokenizer, the block's tokens end with its
newlines and the reply starts a token of its own), which is checked on a probe conversation
when the augmenter is built.
"""

from __future__ import annotations

import numpy as np

from .formats import Conversation, DataError
from .prefix_tokens import encode_text
from .rendering import loss_spans, render, span_mask, tokenize_rendered

SYSTEM_PROMPTS = [
    "你是一个知识丰富的AI，尽力为用户提供准确的信息。",
    "你是minimind，一个小巧但有用的语言模型。",
    "你是一个专业的AI助手，请提供有价值的回答。",
    "你是一个可靠的AI，请给出准确的回答。",
    "You are a helpful AI assistant.",
    "You are minimind, a lightweight intelligent assistant.",
    "You are a friendly chatbot. Please answer the user's questions carefully.",
    "You are a knowledgeable AI. Try your best to provide accurate information.",
]
EMPTY_THINK = "<think>\n\n</think>\n\n"
# The rule by which ``system_room`` finds a sample's own system block (which takes no prompt): --packing 1
# plans every row's room by it, so a resume compares it (trainer/run_identity.py). 1: the block's first
# tokens exactly; 2: their last one also merged with the start of the system text.
ROOM_RULE = 2
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    conversation = Conversation(messages)
    return tokenize_rendered(tokenizer, conversation, render(tokenizer, conversation))[0]


class ChatAugmenter:
    """Draws and applies the augmentations to ``(input_ids, loss_mask)`` of one cached sample."""

    def __init__(self, tokenizer, seed: int, system_prompt_ratio: float = 0.0, drop_empty_think_ratio: float = 0.0):
        for name, ratio in (("system_prompt_ratio", system_prompt_ratio), ("drop_empty_think_ratio", drop_empty_think_ratio)):
            if not 0.0 <= ratio <= 1.0:
                raise DataError(f"--{name} must be in [0, 1], got {ratio}")
        self.seed = seed
        self.system_prompt_ratio = system_prompt_ratio
        self.drop_empty_think_ratio = drop_empty_think_ratio
        plain = _ids(tokenizer, PROBE)
        self.prefixes = []
        for prompt in SYSTEM_PROMPTS if system_prompt_ratio else []:
            with_system = _ids(tokenizer, [{"role": "system", "content": prompt}] + PROBE)
            if with_system[len(with_system) - len(plain):] != plain:
                raise DataError("--system_prompt_ratio: the chat template does not render a system prompt as a prefix")
            self.prefixes.append(np.asarray(with_system[: len(with_system) - len(plain)], dtype=np.int64))
        # A sample that starts like a system prefix already has a system prompt (or a tools block).
        self.system_head = self.prefixes[0][: _common_prefix(self.prefixes)] if self.prefixes else None
        # The head's last token ("\n" after the role) merges with text that starts like it: a system
        # text "\nBe brief." gives "\n\n". So that position takes every token whose text starts with it.
        self.head_end = _tokens_starting_with(tokenizer, self.system_head[-1]) if self.prefixes and len(
            self.system_head) else None
        self.empty_think = np.asarray(encode_text(tokenizer, EMPTY_THINK)[0], dtype=np.int64)
        if drop_empty_think_ratio:
            text, spans = loss_spans(tokenizer, Conversation(PROBE))
            offsets = np.asarray(tokenize_rendered(tokenizer, Conversation(PROBE), text)[1], dtype=np.int64)
            dropped = self._drop(np.asarray(plain, dtype=np.int64), span_mask(offsets.reshape(-1, 2), spans))[0]
            expected = encode_text(tokenizer, text.replace(EMPTY_THINK, ""))[0]
            if EMPTY_THINK not in text or dropped.tolist() != expected:
                raise DataError("--drop_empty_think_ratio: the chat template and tokenizer give no separable empty think block")

    @property
    def active(self) -> bool:
        return bool(self.system_prompt_ratio or self.drop_empty_think_ratio)

    def max_added(self) -> int:
        """The most tokens an augmentation adds to a sample."""
        return max((len(p) for p in self.prefixes), default=0)

    def system_room(self, tokens: np.ndarray, offsets: np.ndarray, max_seq_len: int) -> np.ndarray:
        """Per sample of a cache (``tokens``, ``offsets``): -1 where it has a system prompt (or tools) and
        takes none, else the tokens a system prompt may add to it within ``max_seq_len``
        (``max_added()`` at most). A drawn prompt is added where it takes at most that many tokens."""
        lengths = np.diff(np.asarray(offsets, dtype=np.int64))
        room = np.minimum(self.max_added(), np.maximum(max_seq_len - lengths, 0))
        long_enough = np.flatnonzero(lengths >= len(self.system_head))
        starts = np.asarray(offsets[:-1], dtype=np.int64)[long_enough]
        has_system = self._open_system(np.asarray(tokens[starts[:, None] + np.arange(len(self.system_head))]))
        room[long_enough[has_system]] = -1
        return room

    def _open_system(self, firsts: np.ndarray) -> np.ndarray:
        """Per row of ``firsts`` (the first ``len(system_head)`` tokens of samples): whether they open a
        system block, the head's last token possibly merged with the start of the system text."""
        head = self.system_head
        if not len(head):
            return np.ones(len(firsts), dtype=bool)
        last = firsts[:, -1]
        known = last < len(self.head_end)
        ends = np.zeros(len(firsts), dtype=bool)
        ends[known] = self.head_end[last[known]]
        return (firsts[:, :-1] == head[:-1]).all(axis=1) & ends

    def room_note(self, rooms: list[np.ndarray], max_seq_len: int) -> str:
        """The start summary's line: how many samples (``system_room`` of each file) have room for a
        system prompt, and the fraction of the samples without one that get one."""
        sizes = np.asarray([len(prefix) for prefix in self.prefixes])
        room = np.concatenate(rooms)
        open_room = room[room >= 0]
        fitting = (sizes[None, :] <= open_room[:, None]).mean(axis=1)  # the share of the prompts that fit
        every, none = int((fitting == 1).sum()), int((fitting == 0).sum())
        applied = self.system_prompt_ratio * float(fitting.mean()) if len(open_room) else 0.0
        return (f"[data] --system_prompt_ratio {self.system_prompt_ratio:g}: {every} of {len(open_room)} samples "
                f"without a system prompt have room for one within --max_seq_len {max_seq_len}, "
                f"{len(open_room) - every - none} only for the shorter prompts, {none} for none; "
                f"{applied:.1%} of them get one")

    def draw(self, epoch: int, index: int) -> tuple[int | None, bool]:
        """(system prompt number or None, drop empty think blocks) for this sample in this epoch."""
        rng = np.random.default_rng([self.seed, epoch, index])
        system_u, think_u, choice = rng.random(), rng.random(), int(rng.integers(len(SYSTEM_PROMPTS)))
        prompt = choice if self.prefixes and system_u < self.system_prompt_ratio else None
        return prompt, think_u < self.drop_empty_think_ratio

    def apply(self, ids: np.ndarray, mask: np.ndarray, epoch: int, index: int, room: int) -> tuple[np.ndarray, np.ndarray]:
        """The augmented sample; a system prompt is added only if it fits in ``room`` more tokens."""
        prompt, drop = self.draw(epoch, index)
        if drop:
            ids, mask = self._drop(ids, mask)
        if prompt is not None and not self._has_system(ids) and len(self.prefixes[prompt]) <= room:
            prefix = self.prefixes[prompt]
            ids = np.concatenate([prefix, ids])
            mask = np.concatenate([np.zeros(len(prefix), dtype=bool), mask])
        return ids, mask

    def _has_system(self, ids: np.ndarray) -> bool:
        head = self.system_head
        return len(ids) >= len(head) and bool(self._open_system(ids[None, : len(head)])[0])

    def _drop(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``ids`` and ``mask`` without the empty think blocks that open a run of loss tokens (an
        assistant turn's span); a block inside the run is reply text. A sample whose loss tokens are
        all in such blocks (cut by ``max_seq_len`` right after one) keeps them: without, it would have
        no loss token, and such a sample is never trained on."""
        block = self.empty_think
        if len(ids) < len(block):
            return ids, mask
        windows = np.lib.stride_tricks.sliding_window_view(ids, len(block))
        opens = mask.copy()
        opens[1:] &= ~mask[:-1]
        starts = np.flatnonzero((windows == block).all(axis=1) & opens[: len(windows)])
        keep = np.ones(len(ids), dtype=bool)
        last_end = -1
        for start in starts.tolist():
            if start >= last_end:
                keep[start : start + len(block)] = False
                last_end = start + len(block)
        if not mask[keep].any():
            return ids, mask
        return ids[keep], mask[keep]


def _tokens_starting_with(tokenizer, token_id: int) -> np.ndarray:
    """Per token id of the tokenizer: whether its text starts with the text of token ``token_id``."""
    texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    start = texts[int(token_id)]
    return np.asarray([text is not None and text.startswith(start) for text in texts], dtype=bool)


def _common_prefix(arrays: list[np.ndarray]) -> int:
    """Length of the token prefix all arrays share (the system header of a system prefix)."""
    n = 0
    while all(len(a) > n for a in arrays) and len({int(a[n]) for a in arrays}) == 1:
        n += 1
    return n
