"""The ChatML encoder tokenizes a text in pieces (cut at the added tokens) only where that gives the
ids of the whole text (dataset/pieces.py): a pre-tokenizer that looks at where a part starts
(Metaspace ``prepend_scheme="first"``, how transformers builds Llama's tokenizer) puts "▁" before
every piece tokenized alone, ids that ``tokenizer(text)`` (chat, evaluation, the inspector) never
gives. Every pre-tokenizer type the pieces accept is built here and checked against the general path."""

import re

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dataset import build_cache_and_open, chatml, load_tokenizer
from dataset.cache.key import TOKENS_VERSION, cache_key, file_digest
from dataset.chatml_encoder import ChatMLEncoder
from dataset.formats import parse_line
from tests.dataset.test_fast_path import DEMO_FILES, RANDOM, assert_same_as_general

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPLIT = re.compile("(" + "|".join(map(re.escape, SPECIALS)) + ")")


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def demo_lines():
    """Every tenth line of the demo set (tools, tool calls, reasoning, Chinese and English)."""
    return [line for path in DEMO_FILES for line in open(path, encoding="utf-8") if line.strip()][::10]


@pytest.fixture(scope="module")
def demo_rows(demo_lines):
    return [parse_line(line) for line in demo_lines]


def make_tokenizer(pre_tokenizer, template: str, demo_rows) -> PreTrainedTokenizerFast:
    """A BPE of 700 tokens (the 256 of byte-level among them) trained here on ChatML renderings, with
    ``pre_tokenizer`` and ``template``."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer
    corpus = [chatml.render(conversation)[0] for conversation in chatml.PROBES + demo_rows[:200]]
    backend.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=template)


def in_pieces(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` cut at the special tokens, each part tokenized alone."""
    ids = []
    for number, piece in enumerate(SPLIT.split(text)):
        if number & 1:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def test_a_sentencepiece_style_tokenizer_is_tokenized_whole_and_its_cache_holds_the_whole_text_s_ids(
        shipped, demo_lines, demo_rows, tmp_path):
    llama_like = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer = make_tokenizer(llama_like, shipped.chat_template, demo_rows)
    assert tokenizer.backend_tokenizer.normalizer is None and chatml.matches_template(tokenizer)
    rows = demo_rows[:40]
    texts = [chatml.render(conversation)[0] for conversation in rows]
    whole = [tokenizer(text)["input_ids"] for text in texts]
    assert all(in_pieces(tokenizer, text) != ids for text, ids in zip(texts, whole))  # "▁" before every piece

    assert ChatMLEncoder(tokenizer, 4096).split_pattern is None  # pieces refused
    data = tmp_path / "d.jsonl"
    data.write_text("".join(demo_lines[:len(rows)]), encoding="utf-8")
    ds = build_cache_and_open(data, tokenizer, 4096, num_proc=1)
    assert len(ds) == len(rows)
    for i, ids in enumerate(whole):
        assert ds[i]["input_ids"].tolist() == ids, i
    # not the key of tokens version 3, whose caches of this tokenizer hold the pieces' ids
    assert TOKENS_VERSION > 3 and ds.cache.path.name != cache_key(file_digest(data), tokenizer, 4096, 3, 1)
    assert_same_as_general(tokenizer, rows + RANDOM[:200], 4096)


def test_the_shipped_tokenizer_keeps_its_pieces_with_the_whole_text_s_ids(shipped, demo_rows):
    encoder = ChatMLEncoder(shipped, 4096)
    assert encoder.split_pattern is not None
    results = encoder.encode(demo_rows)
    assert encoder.piece_chars > 0  # tokenized in pieces
    for conversation, (ids, _) in zip(demo_rows, results):
        assert ids.tolist() == shipped(chatml.render(conversation)[0])["input_ids"]


PRE_TOKENIZERS = {  # every type dataset.pieces accepts (PART_LOCAL, and Metaspace as it allows it)
    "BertPreTokenizer": [pre_tokenizers.BertPreTokenizer()],
    "ByteLevel": [pre_tokenizers.ByteLevel(add_prefix_space=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)],
    "CharDelimiterSplit": [pre_tokenizers.CharDelimiterSplit("\n")],
    "Digits": [pre_tokenizers.Digits(individual_digits=True)],
    "FixedLength": [pre_tokenizers.FixedLength(length=3)],
    "Metaspace": [pre_tokenizers.Metaspace(prepend_scheme="always"),
                  pre_tokenizers.Metaspace(prepend_scheme="never", split=False)],
    "Punctuation": [pre_tokenizers.Punctuation()],
    "Split": [pre_tokenizers.Split(" ", "merged_with_next")],
    "UnicodeScripts": [pre_tokenizers.UnicodeScripts()],
    "Whitespace": [pre_tokenizers.Whitespace()],
    "WhitespaceSplit": [pre_tokenizers.WhitespaceSplit()],
    "Sequence": [pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Metaspace(prepend_scheme="always")])],
    "none": [None],
}
CASES = [(kind, number) for kind, variants in PRE_TOKENIZERS.items() for number in range(len(variants))]


def test_every_pre_tokenizer_type_the_pieces_accept_is_checked_here():
    from dataset.pieces import PART_LOCAL

    assert set(PRE_TOKENIZERS) == PART_LOCAL | {"Metaspace", "Sequence", "none"}


@pytest.mark.parametrize("kind,number", CASES)
def test_an_accepted_pre_tokenizer_gives_the_general_path_s_ids_in_pieces(shipped, demo_rows, kind, number):
    tokenizer = make_tokenizer(PRE_TOKENIZERS[kind][number], shipped.chat_template, demo_rows)
    encoder = assert_same_as_general(tokenizer, demo_rows[::20] + RANDOM[:150], 1024)
    assert encoder.split_pattern is not None and encoder.piece_chars > 0


@pytest.mark.parametrize("refused", ["first", "sequence", "custom"])
def test_a_pre_tokenizer_that_may_look_at_where_a_part_starts_is_refused(shipped, demo_rows, refused):
    """Metaspace "first" (alone or in a Sequence) by its type and by the proof on token ids; a type the
    list does not name (a custom Python pre-tokenizer, here one that splits at spaces only) by its type."""
    from dataset.pieces import pieces_give_whole_ids, probe_texts

    class AtSpaces:
        def pre_tokenize(self, pretok):
            pretok.split(lambda _, part: part.split(" ", "isolated"))

    first = pre_tokenizers.Metaspace(prepend_scheme="first")
    chosen = {"first": first, "sequence": pre_tokenizers.Sequence([pre_tokenizers.Digits(), first]),
              "custom": pre_tokenizers.Whitespace()}[refused]
    tokenizer = make_tokenizer(chosen, shipped.chat_template, demo_rows)
    if refused == "custom":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(AtSpaces())
    else:
        assert not pieces_give_whole_ids(tokenizer, SPLIT, probe_texts(SPECIALS))
    encoder = assert_same_as_general(tokenizer, demo_rows[::20] + RANDOM[:150], 1024)
    assert encoder.fast and encoder.split_pattern is None
    assert np.all(encoder.encode(demo_rows[:1])[0][0] == tokenizer(chatml.render(demo_rows[0])[0])["input_ids"])
