"""The seam from a conversation to its tokens (dataset/tokens.py): what the general path gives, for
the template the tokenizer has when it is called, and the line's error raised for one conversation."""

import copy

import numpy as np
import pytest

from dataset import load_tokenizer
from dataset.formats import Conversation, LineError
from dataset.rendering import encode_with_template
from dataset.tokens import encode_conversation, encode_conversations, uses_chatml_encoder

CONVERSATIONS = [
    Conversation([{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]),
    Conversation([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of Zorlia?"},
                  {"role": "assistant", "content": "Vilm."}, {"role": "user", "content": "Sure?"},
                  {"role": "assistant", "content": "Yes."}]),
]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def assert_general(tokenizer, max_seq_len: int) -> None:
    for conversation, (ids, mask) in zip(CONVERSATIONS, encode_conversations(tokenizer, CONVERSATIONS, max_seq_len)):
        expected_ids, expected_mask = encode_with_template(tokenizer, conversation, max_seq_len)
        assert np.array_equal(ids, expected_ids) and np.array_equal(mask, expected_mask)
        assert mask.any() or max_seq_len < 10


def test_the_seam_follows_a_template_set_on_the_tokenizer_after_it_was_used():
    tokenizer = copy.deepcopy(load_tokenizer(None))
    assert uses_chatml_encoder(tokenizer)
    assert_general(tokenizer, 64)
    tokenizer.chat_template = PLAIN_TEMPLATE  # the same tokenizer object, another template
    assert not uses_chatml_encoder(tokenizer)
    assert_general(tokenizer, 64)
    assert_general(tokenizer, 5)  # another max_seq_len


def test_one_conversation_gives_its_ids_or_raises_its_line_error():
    tokenizer = load_tokenizer(None)
    ids, mask = encode_conversation(tokenizer, CONVERSATIONS[0].messages, 64)  # a message list is accepted
    assert ids.dtype == np.int64 and mask.dtype == bool and len(ids) == len(mask)
    with pytest.raises(LineError, match="conversation starts with an assistant message"):
        encode_conversation(tokenizer, [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], 64)
