"""Token ids and loss masks of a chunk of conversations at once: the build's encoder.

``ChunkEncoder.encode`` gives, for each conversation, what ``rendering.encode_conversation`` gives
(the general path, which works for any chat template), or the ``LineError`` it raises. It is
faster in two ways, each used only where it gives the same tokens and masks:

* **Rendering.** For a tokenizer whose template is the ChatML layout of ``chatml`` (checked once
  per template on ``chatml.PROBES``), each conversation is rendered once in Python with its loss
  spans (``chatml.render``) instead of several Jinja renderings per assistant turn. Rows that the
  general path treats specially stay on it: data that spells a special token (tokenized as text
  there), a lone surrogate (an error there), an assistant turn first (an error there). Any other
  template: the general path for every row.
* **Tokenizing.** The texts of the chunk go to the tokenizer's backend in one ``encode_batch``
  call (``tokenizer(texts)`` without its per-call conversions): the same ids and character offsets
  as one call per text. A text too long for the chunk (more characters than
  ``prefix_tokens`` reads first) goes through ``prefix_tokens.encode_text`` as before. A system
  turn (the tools block of tool rows, a system prompt) repeats across rows: it is tokenized once
  and remembered, and only the rest of the text is encoded. That split is exact: the tokenizer
  first cuts the text at its added tokens (``<|im_end|>``) and tokenizes the pieces between them
  on their own, so a text cut right after an added token that the tokenizer matches there
  (``_cut_is_a_split``: the same leftmost-longest matching) gives the ids of both parts, end to
  end, with offsets shifted. It is used only for tokenizers without a normalizer and whose added
  tokens strip no whitespace (``_splits_at_added_tokens``).

A token carries loss when its characters overlap a span, as in the general path.
``tests/dataset/test_fast_path.py`` compares this encoder with ``encode_conversation`` token for
token and mask for mask on the whole demo set, random conversations and every template the tests
know.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from . import chatml
from .formats import Conversation, LineError
from .prefix_tokens import FIRST_WINDOW_CHARS_PER_TOKEN, MIN_WINDOW_CHARS, encode_text
from .rendering import _strings, encode_conversation, special_token_texts

_SURROGATE = re.compile("[\ud800-\udfff]")  # not valid Unicode: the general path's error
PREFIX_CACHE_ENTRIES = 1024  # system turns remembered per process (cleared when full)


def _splits_at_added_tokens(tokenizer) -> bool:
    """The backend cuts raw text at its added tokens' exact text, and at nothing else of theirs."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        return False
    return all(not (token.lstrip or token.rstrip or token.single_word) for token in tokenizer.added_tokens_decoder.values())


class ChunkEncoder:
    """Encodes conversations for one tokenizer and ``max_seq_len`` (see the module docstring)."""

    def __init__(self, tokenizer, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.fast = chatml.matches_template(tokenizer)
        self.specials = special_token_texts(tokenizer)
        self.window = max(MIN_WINDOW_CHARS, FIRST_WINDOW_CHARS_PER_TOKEN * max_seq_len)
        added = [token for token in tokenizer.added_tokens_decoder.values() if not token.normalized]
        self.split_pattern = None
        if self.fast and added and _splits_at_added_tokens(tokenizer):
            texts = sorted({token.content for token in added}, key=len, reverse=True)  # longest first at a position
            self.split_pattern = re.compile("|".join(map(re.escape, texts)))
            self.longest_added = len(texts[0])
        self.prefixes: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ per row

    def _general(self, conversation: Conversation):
        try:
            return encode_conversation(self.tokenizer, conversation, self.max_seq_len)
        except LineError as exc:
            return exc

    def _spells_special(self, conversation: Conversation) -> bool:
        """Does any string of the data contain a special token's text (as ``rendering`` asks)."""
        blob = "\x00".join(_strings([conversation.messages, conversation.tools]))
        return any(special in blob for special in self.specials)

    def _cut_is_a_split(self, text: str, cut: int) -> bool:
        """Does the tokenizer's added-token matching (leftmost, longest) end a match at ``cut``."""
        for match in self.split_pattern.finditer(text, 0, min(len(text), cut + self.longest_added)):
            if match.end() == cut:
                return True
            if match.start() >= cut:
                break
        return False

    def _mask(self, ids: list | np.ndarray, offsets: np.ndarray, spans) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)[: self.max_seq_len]
        offsets = offsets[: self.max_seq_len]
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        return ids, mask

    # ------------------------------------------------------------------ the chunk

    def encode(self, conversations: list[Conversation]) -> list:
        """For each conversation: (int64 ids, bool mask) cut to ``max_seq_len``, or its ``LineError``."""
        results: list = [None] * len(conversations)
        batch: list[tuple[int, str, list, int]] = []  # (index, text to encode, spans, cut)
        for index, conversation in enumerate(conversations):
            rendered = chatml.render(conversation) if self.fast else None
            if rendered is None or self._spells_special(conversation):
                results[index] = self._general(conversation)
                continue
            text, spans, head = rendered
            if not text.isascii() and _SURROGATE.search(text):
                results[index] = self._general(conversation)
                continue
            if len(text) > self.window:
                ids, offsets = encode_text(self.tokenizer, text, self.max_seq_len)
                results[index] = self._mask(ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
                continue
            cut = head if head and self.split_pattern is not None and self._cut_is_a_split(text, head) else 0
            batch.append((index, text, spans, cut))
        if batch:
            self._encode_batch(batch, results)
        return results

    def _encode_batch(self, batch, results) -> None:
        backend = self.tokenizer.backend_tokenizer
        # What ``tokenizer(text, add_special_tokens=False)`` sets on the backend before encoding.
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        backend.encode_special_tokens = False
        prefixes = self.prefixes
        new_prefixes = {text[:cut] for _, text, _, cut in batch if cut and text[:cut] not in prefixes}
        if len(prefixes) + len(new_prefixes) > PREFIX_CACHE_ENTRIES:
            prefixes.clear()
            new_prefixes = {text[:cut] for _, text, _, cut in batch if cut}
        new_prefixes = sorted(new_prefixes)
        texts = [text[cut:] for _, text, _, cut in batch]
        encodings = backend.encode_batch(new_prefixes + texts, add_special_tokens=False)
        for prefix, encoding in zip(new_prefixes, encodings):
            prefixes[prefix] = (np.asarray(encoding.ids, dtype=np.int64), _offsets(encoding.offsets))
        for (index, text, spans, cut), encoding in zip(batch, encodings[len(new_prefixes):]):
            ids, offsets = encoding.ids, _offsets(encoding.offsets)
            if cut:
                head_ids, head_offsets = prefixes[text[:cut]]
                ids = np.concatenate([head_ids, np.asarray(ids, dtype=np.int64)])
                offsets = np.concatenate([head_offsets, offsets + cut])
            results[index] = self._mask(ids, offsets, spans)


def _offsets(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs)).reshape(-1, 2)
