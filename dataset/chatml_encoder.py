"""The fast ChatML encoder: token ids and loss masks of a batch of conversations at once, behind
the seam ``tokens.encode_conversations``.

``ChatMLEncoder.encode`` gives, for each conversation, what ``rendering.encode_with_template`` gives
(the general path, which works for any chat template), or the ``LineError`` it raises. It is
faster in three ways, each used only where it gives the same tokens and masks:

* **Rendering.** For a tokenizer whose template is the ChatML layout of ``chatml`` (checked once
  per template on ``chatml.PROBES``), each conversation is rendered once in Python with its loss
  spans (``chatml.render``) instead of several Jinja renderings per assistant turn. Rows that the
  general path treats specially stay on it: data that spells a special token (tokenized as text
  there), a lone surrogate (an error there), an assistant turn first (an error there). Any other
  template: the general path for every row.
* **Tokenizing in pieces.** A tokenizer first cuts the text at its added tokens (``<|im_start|>``,
  ``<|im_end|>``: leftmost, longest match first) and tokenizes the parts between them each on its
  own; for a pre-tokenizer that looks only at a part's characters (not at where the part starts)
  the ids of a text are the pieces' ids and the added tokens' ids end to end, and a piece's
  offsets are its own shifted by where it starts. ``split_pattern`` makes that same cut, for a
  tokenizer where ``pieces.piece_split`` proves it on token ids; others tokenize each whole text.
  The pieces a chunk has not seen go to the backend in one ``encode_batch`` call (what
  ``tokenizer(texts)`` calls, without its per-text conversions); every piece is remembered
  (``PIECE_CACHE_CHARS``), so a repeated system prompt, tools block, tool call or reply is
  tokenized once.
* **Masks per piece.** A token carries loss when its characters overlap a span (the general
  path's rule). A piece or added token that no span overlaps carries none without looking at its
  tokens; only the pieces a span boundary falls in use their offsets.

A text too long for the chunk (more characters than ``prefix_tokens`` reads first) goes through
``prefix_tokens.encode_text`` as in the general path. ``tests/dataset/test_fast_path.py``
compares this encoder with ``encode_with_template`` token for token, mask for mask and error for
error on the whole demo set, random conversations and every template the tests know.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from . import chatml
from .formats import Conversation, LineError
from .pieces import piece_split, plain_backend
from .prefix_tokens import FIRST_WINDOW_CHARS_PER_TOKEN, MIN_WINDOW_CHARS, encode_text
from .rendering import data_strings, encode_with_template, span_mask, special_token_texts

_SURROGATE = re.compile("[\ud800-\udfff]")  # not valid Unicode: the general path's error
PIECE_CACHE_CHARS = 1 << 21  # characters of remembered pieces per process (all forgotten when full)
PIECE_MASKS = 1 << 14  # masks of pieces a span boundary falls in, remembered (all forgotten when full)
_JSON_ESCAPED = re.compile(r'["\\\x00-\x1f]')  # what json.dumps(ensure_ascii=False) writes otherwise


def _offsets(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs)).reshape(-1, 2)


class ChatMLEncoder:
    """Encodes conversations for one tokenizer and ``max_seq_len`` (see the module docstring)."""

    def __init__(self, tokenizer, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.fast = chatml.matches_template(tokenizer)
        self.specials = special_token_texts(tokenizer)
        # Data strings are looked for in their JSON where no special token has a character JSON escapes.
        self.specials_survive_json = not any(_JSON_ESCAPED.search(special) for special in self.specials)
        self.window = max(MIN_WINDOW_CHARS, FIRST_WINDOW_CHARS_PER_TOKEN * max_seq_len)
        self.split_pattern = None
        self.added_ids: dict[str, int] = {}
        split = piece_split(tokenizer) if self.fast else None
        if split is not None:
            self.split_pattern, self.added_ids = split
        self.pieces: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # piece -> (ids, offsets in the piece)
        self.piece_chars = 0
        self.piece_masks: dict[tuple, np.ndarray] = {}  # (piece, spans in its characters) -> its tokens' loss mask
        self.added_arrays = {text: np.array([token_id], dtype=np.int64) for text, token_id in self.added_ids.items()}
        self.systems: dict[str, bool] = {}  # system turn text -> does it spell a special token

    # ------------------------------------------------------------------ per row

    def _general(self, conversation: Conversation):
        try:
            return encode_with_template(self.tokenizer, conversation, self.max_seq_len)
        except LineError as exc:
            return exc

    def _spells_special(self, conversation: Conversation, text: str, head: int) -> bool:
        """Does any string of the data contain a special token's text (as ``rendering`` asks). The
        tools are looked for in the rendered system turn (their JSON holds each of their strings
        unchanged, when no special token has a character JSON escapes), once per system turn."""
        tools = conversation.tools
        if not self.specials_survive_json:
            strings = data_strings([conversation.messages, tools])
        else:
            strings = []
            for message in conversation.messages:
                for value in message.values():
                    if isinstance(value, str):
                        strings.append(value)
                    else:
                        strings += data_strings(value)
        if any(special in "\x00".join(strings) for special in self.specials):
            return True
        if tools and self.specials_survive_json:
            system = text[len(chatml.IM_START): head - len(chatml.IM_END)]
            if system not in self.systems:
                if len(self.systems) > 1024:
                    self.systems.clear()
                self.systems[system] = any(special in system for special in self.specials)
            return self.systems[system]
        return False

    def _mask(self, ids, offsets: np.ndarray, spans) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(ids, dtype=np.int64)[: self.max_seq_len], span_mask(offsets[: self.max_seq_len], spans)

    # ------------------------------------------------------------------ the chunk

    def encode(self, conversations: list[Conversation]) -> list:
        """For each conversation: (int64 ids, bool mask) cut to ``max_seq_len``, or its ``LineError``."""
        results: list = [None] * len(conversations)
        rows = []  # (index, text, spans, pieces)
        for index, conversation in enumerate(conversations):
            rendered = chatml.render(conversation) if self.fast else None
            if rendered is None:
                results[index] = self._general(conversation)
                continue
            text, spans, head = rendered
            if self._spells_special(conversation, text, head) or (not text.isascii() and _SURROGATE.search(text)):
                results[index] = self._general(conversation)
            elif len(text) > self.window:
                ids, offsets = encode_text(self.tokenizer, text, self.max_seq_len)
                results[index] = self._mask(ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
            elif self.split_pattern is None:
                rows.append((index, text, spans, None))
            else:  # pieces and added tokens in turn, as the tokenizer cuts the text (module docstring)
                rows.append((index, text, spans, self.split_pattern.split(text)))
        if rows:
            self._encode_rows(rows, results)
        return results

    def _encode_rows(self, rows, results) -> None:
        backend = plain_backend(self.tokenizer)
        whole = [text for _, text, _, pieces in rows if pieces is None]
        wanted = set()
        for _, _, _, pieces in rows:
            if pieces is not None:
                wanted.update(pieces[0::2])
        wanted.discard("")
        if self.piece_chars + sum(map(len, wanted)) > PIECE_CACHE_CHARS:
            self.pieces.clear()
            self.piece_chars = 0
        new = [piece for piece in wanted if piece not in self.pieces]
        encodings = backend.encode_batch(whole + new, add_special_tokens=False)
        for piece, encoding in zip(new, encodings[len(whole):]):
            self.pieces[piece] = (np.asarray(encoding.ids, dtype=np.int64), _offsets(encoding.offsets))
            self.piece_chars += len(piece)
        whole_encodings = iter(encodings[: len(whole)])
        for index, text, spans, pieces in rows:
            if pieces is None:
                encoding = next(whole_encodings)
                results[index] = self._mask(encoding.ids, _offsets(encoding.offsets), spans)
            else:
                results[index] = self._assemble(text, spans, pieces)

    def _assemble(self, text: str, spans, pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask of a text from its pieces (module docstring), cut to ``max_seq_len``."""
        parts = []  # id arrays, end to end
        touched = []  # (first token, piece start, end, offsets or None for an added token, first span it meets, piece number)
        count = position = span = 0
        cache, added_arrays, last = self.pieces, self.added_arrays, len(spans)
        for number, piece in enumerate(pieces):
            if not piece:
                continue
            end = position + len(piece)
            if number & 1:
                ids, offsets = added_arrays[piece], None
            else:
                ids, offsets = cache[piece]
            while span < last and spans[span][1] <= position:
                span += 1
            if span < last and spans[span][0] < end:
                touched.append((count, position, end, offsets, span, number))
            parts.append(ids)
            count += len(ids)
            position = end
            if count >= self.max_seq_len:
                break
        ids = np.concatenate(parts)[: self.max_seq_len] if parts else np.zeros(0, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        for first, start, end, offsets, span, number in touched:
            meets = itertools.takewhile(lambda pair: pair[0] < end, spans[span:])  # sorted, not overlapping
            if offsets is None:  # an added token: its characters are [start, end) of its match
                mask[first] = any(end > s and start < e for s, e in meets)
                continue
            meets = tuple((s - start, e - start) for s, e in meets)  # in the piece's own characters
            key = (pieces[number], meets)
            hit = self.piece_masks.get(key)
            if hit is None:
                hit = np.zeros(len(offsets), dtype=bool)
                for s, e in meets:
                    hit |= (offsets[:, 1] > s) & (offsets[:, 0] < e)
                if len(self.piece_masks) > PIECE_MASKS:
                    self.piece_masks.clear()
                self.piece_masks[key] = hit
            hit = hit[: len(ids) - first]
            mask[first:first + len(hit)] = hit
        return ids, mask
