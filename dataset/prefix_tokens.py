"""The first ``max_tokens`` tokens of a text without tokenizing all of it.

A sample is cut to ``max_seq_len`` tokens; tokenizing the whole rendered text first would turn
one 20 MB line into ~8 million tokens held as Python lists of ids and offset tuples (plus the
tokenizer's own encoding), a 3.9 GB peak for a sample that keeps 512 of them
(docs/token_cache.md, "One huge line").

``encode_text`` tokenizes a prefix of the text instead, doubling it until the first ``max_tokens``
tokens of two prefixes (``W`` and ``2 W`` characters) agree, or until the prefix is the whole text.
Tokenizers work on the text left to right in pieces (added tokens split it; the pre-tokenizer
splits it into words; the model tokenizes each word): cutting the text changes only the
tokens of the word the cut falls in, and the first ``max_tokens`` tokens end long before the cut
(the first window gives ``FIRST_WINDOW_CHARS_PER_TOKEN`` characters to each wanted token, several
times what any text needs). The check of two cuts covers the rest (one very long word, e.g. a
template without a pre-tokenizer): the tokens are those of tokenizing the whole text
(``test_a_long_text_gives_the_tokens_of_the_whole_text``, and the golden digest of the cache).
"""

from __future__ import annotations

FIRST_WINDOW_CHARS_PER_TOKEN = 8
MIN_WINDOW_CHARS = 4096


def _encode(tokenizer, text: str, **kwargs) -> tuple[list[int], list[tuple[int, int]]]:
    # The special-token text a template writes is its special token, also for a tokenizer saved with
    # ``split_special_tokens`` set (its default for every call); data text passes True (rendering).
    kwargs = {"split_special_tokens": False, **kwargs}
    # verbose=False: no warning that the ids outrun the model's positions (model_max_length); the
    # callers cut them to --max_seq_len, or say themselves that a prompt is too long (chat.py)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False, **kwargs)
    return list(encoding["input_ids"]), list(encoding["offset_mapping"])


def encode_text(tokenizer, text: str, max_tokens: int | None = None, **kwargs) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``tokenizer(text, add_special_tokens=False, **kwargs)``;
    with ``max_tokens``, only the first ``max_tokens`` of them, from prefixes of a long ``text``
    (memory and time follow ``max_tokens``, not the length of the text)."""
    if max_tokens is None:
        return _encode(tokenizer, text, **kwargs)
    window = max(MIN_WINDOW_CHARS, FIRST_WINDOW_CHARS_PER_TOKEN * max_tokens)
    head = None
    while window < len(text):
        ids, offsets = _encode(tokenizer, text[:window], **kwargs)
        if len(ids) > max_tokens:
            candidate = (ids[:max_tokens], offsets[:max_tokens])
            if candidate == head:
                return candidate
            head = candidate
        window *= 2
    ids, offsets = _encode(tokenizer, text, **kwargs)
    return ids[:max_tokens], offsets[:max_tokens]
