"""The one seam from a conversation to its tokens: token ids and the loss mask of its assistant turns.

Every path that turns a conversation into training tokens calls ``encode_conversations`` (or
``encode_conversation`` for one): the token cache build (``cache.build``), evaluation
(``scripts/eval_sft.py``), the data inspector (``inspection.segments``) and the benchmarks. Which
encoder runs behind it:

* **any chat template**: ``rendering.encode_with_template``, the general path: the conversation is
  rendered through the tokenizer's Jinja template, every assistant turn's loss span located in
  that one text, the text tokenized and each token that overlaps a span carries loss.
* **the ChatML layout** (the shipped ``model/tokenizer`` template and MiniMind's; decided once per
  template by ``chatml.matches_template``): ``chatml_encoder.ChatMLEncoder``, an optimisation that
  renders in Python and tokenizes a batch of conversations, in pieces where ``pieces.piece_split``
  proves on token ids that they give the whole text's ids (else whole). It gives the general path's
  ids, mask and errors exactly (``tests/dataset/test_fast_path.py`` compares them token for token
  on the demo set, random conversations and every template the tests know), and hands the rows it
  does not cover (data that spells a special token, a lone surrogate, an assistant turn first) to
  the general path.

Batches are what make the ChatML encoder fast (one backend call per batch, repeated pieces such as
a system prompt tokenized once), so the build passes a chunk of conversations at a time.
"""

from __future__ import annotations

import weakref

import numpy as np

from .chatml import matches_template
from .chatml_encoder import ChatMLEncoder
from .formats import Conversation, LineError
from .rendering import as_conversation

# tokenizer -> {(max_seq_len, chat template, vocabulary size): its encoder}; an encoder remembers the
# pieces it tokenized, so one per tokenizer and max_seq_len is kept while the tokenizer lives.
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def uses_chatml_encoder(tokenizer) -> bool:
    """Does ``encode_conversations`` run the ChatML encoder for this tokenizer's template."""
    return matches_template(tokenizer)


def _encoder(tokenizer, max_seq_len: int) -> ChatMLEncoder:
    encoders = _ENCODERS.setdefault(tokenizer, {})
    key = (max_seq_len, tokenizer.chat_template, len(tokenizer))  # a template or added tokens set later: another encoder
    if key not in encoders:
        encoders.clear()
        encoders[key] = ChatMLEncoder(tokenizer, max_seq_len)
    return encoders[key]


def encode_conversations(tokenizer, conversations: list[Conversation], max_seq_len: int) -> list:
    """For each conversation: (int64 token ids, bool loss mask), cut to ``max_seq_len`` tokens, or the
    ``LineError`` that makes its line bad."""
    return _encoder(tokenizer, max_seq_len).encode(conversations)


def encode_conversation(tokenizer, conversation, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int64) and loss mask (bool) of one conversation (a ``Conversation`` or a message
    list), cut to ``max_seq_len``; raises its ``LineError``."""
    result = encode_conversations(tokenizer, [as_conversation(conversation)], max_seq_len)[0]
    if isinstance(result, LineError):
        raise result
    return result
