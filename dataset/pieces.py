"""Whether a tokenizer's ChatML texts may be tokenized in pieces: cut at its added tokens, each piece
tokenized on its own, the pieces' ids end to end are the ids of the whole text (what
``tokenizer(text)`` gives, so what chat, evaluation and the inspector produce).

The backend cuts a text at its added tokens and pre-tokenizes every part between them; most
pre-tokenizers look only at the characters of the part, so the part gives the same tokens alone.
Some also look at where the part starts in the text: Metaspace with ``prepend_scheme="first"`` (how
transformers builds Llama's and other sentencepiece tokenizers) puts "▁" before the text's first
part only, so every piece tokenized alone would get one. ``piece_split`` allows pieces only when

* the backend cuts raw text at its added tokens' exact text and at nothing else of theirs (no
  normalizer, no added token that strips whitespace or matches single words only);
* every pre-tokenizer in it is of a type that looks only at its part (``PART_LOCAL``; Metaspace
  with ``prepend_scheme`` "always" or "never"); a type not named there is not trusted;
* and the proof on token ids holds: every probe text (the renderings of ``chatml.PROBES``, and each
  added token followed by each kind of first character) gives the same ids and offsets in pieces
  as whole.

Otherwise the ChatML encoder tokenizes every text whole. ``tests/dataset/test_pieces.py`` builds a
tokenizer with every pre-tokenizer type and checks the encoder against the general path.
"""

from __future__ import annotations

import json
import re

from . import chatml

# Pre-tokenizer types (their serialized "type") that split a part by its own characters only.
PART_LOCAL = {"BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "FixedLength", "Punctuation", "Split",
              "UnicodeScripts", "Whitespace", "WhitespaceSplit"}
PART_LOCAL_METASPACE = {"always", "never"}  # "first": "▁" only before the part at the text's start
FIRST_CHARACTERS = [" ", "  ", "\t", "\n", "a", "A", "1", "中", ".", "'s", "▁", "Ġ", "😀"]


def plain_backend(tokenizer):
    """The backend as ``tokenizer(text, add_special_tokens=False)`` sets it before encoding."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = False
    return backend


def _splits_at_added_tokens(tokenizer) -> bool:
    if tokenizer.backend_tokenizer.normalizer is not None:
        return False
    return all(not (token.lstrip or token.rstrip or token.single_word) for token in tokenizer.added_tokens_decoder.values())


def _part_local(state: dict | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_part_local(child) for child in state.get("pretokenizers", ()))
    if kind == "Metaspace":
        return state.get("prepend_scheme") in PART_LOCAL_METASPACE
    return kind in PART_LOCAL


def pre_tokenizer_is_part_local(tokenizer) -> bool:
    """Every pre-tokenizer of the backend is of a ``PART_LOCAL`` type (one that cannot be read is not)."""
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    if pre_tokenizer is None:
        return True
    try:
        state = json.loads(pre_tokenizer.__getstate__())
    except Exception:  # noqa: BLE001 - a custom (Python) pre-tokenizer has no serialized form
        return False
    return _part_local(state)


def probe_texts(added: list[str]) -> list[str]:
    """The renderings of ``chatml.PROBES``, and every added token followed by each first character."""
    texts = [chatml.render(probe)[0] for probe in chatml.PROBES]
    texts += ["x" + token + first + "y z" for token in added for first in FIRST_CHARACTERS]
    return texts


def pieces_give_whole_ids(tokenizer, pattern: re.Pattern, texts: list[str]) -> bool:
    """Do ``texts``, cut by ``pattern`` (its groups: the added tokens) and tokenized piece by piece,
    give the ids and offsets of tokenizing each whole (the proof on token ids)."""
    backend = plain_backend(tokenizer)
    wholes = backend.encode_batch(texts, add_special_tokens=False)
    cuts = [pattern.split(text) for text in texts]
    pieces = sorted({piece for parts in cuts for piece in parts if piece})
    encoded = dict(zip(pieces, backend.encode_batch(pieces, add_special_tokens=False)))
    for whole, parts in zip(wholes, cuts):
        ids, offsets, position = [], [], 0
        for piece in parts:
            if piece:
                encoding = encoded[piece]
                ids += encoding.ids
                offsets += [(start + position, end + position) for start, end in encoding.offsets]
            position += len(piece)
        if ids != whole.ids or offsets != list(whole.offsets):
            return False
    return True


def piece_split(tokenizer) -> tuple[re.Pattern, dict[str, int]] | None:
    """(the pattern that cuts a text at the tokenizer's added tokens, added token text -> id) where
    tokenizing in pieces gives the whole text's ids (module docstring), else ``None``."""
    added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items() if not token.normalized}
    if not added or not _splits_at_added_tokens(tokenizer) or not pre_tokenizer_is_part_local(tokenizer):
        return None
    texts = sorted(added, key=len, reverse=True)  # the longest first at a position
    pattern = re.compile("(" + "|".join(map(re.escape, texts)) + ")")
    return (pattern, added) if pieces_give_whole_ids(tokenizer, pattern, probe_texts(texts)) else None
