"""What names a token cache (dataset/cache/key.py): a cache is reused without tokenizing while its
file, tokenizer and ``max_seq_len`` stay, and built again when one changes; an unchanged file is
found without hashing it again, a changed one is hashed again, also after a same-size edit with its
mtime kept."""

import json
import os
import shutil

import numpy as np
import pytest

import dataset.cache.key as digests
from dataset import ChatAugmenter, build_cache_and_open, load_tokenizer
from dataset.rendering import DEFAULT_TOKENIZER_DIR, prompt_token_ids, tokenizer_fingerprint
from dataset.tokens import encode_conversation
from tests.helpers.chat_rows import chat_line, make_chat, write_lines, write_rows
from tests.helpers.templates import PLAIN_CHATML, make_alt_tokenizer, with_template
from trainer.evaluation.evaluate import stop_token_ids


def test_cache_is_reused_without_tokenizing_and_rebuilt_on_changes(tokenizer, tmp_path, monkeypatch):
    path = write_lines(tmp_path / "data.jsonl", [make_chat(i) for i in range(20)])
    first = build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert first.cache.path.parent == tmp_path / ".cache"
    assert first.tokens.dtype == np.uint16
    assert np.asarray(first.offsets).dtype == np.int64 and len(first.offsets) == 21

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the tokenizer was called")

    with monkeypatch.context() as patch:
        for name in ("__call__", "encode", "apply_chat_template"):
            patch.setattr(type(tokenizer), name, no_tokenizing)
        second = build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert second.cache.path == first.cache.path
    assert all(np.array_equal(first[i]["input_ids"], second[i]["input_ids"]) for i in range(20))

    changed_len = build_cache_and_open(path, tokenizer, 96, num_proc=1)
    assert changed_len.cache.path != first.cache.path

    other_tokenizer = load_tokenizer(make_alt_tokenizer(tmp_path / "alt_tok"))
    changed_tok = build_cache_and_open(path, other_tokenizer, 128, num_proc=1)
    assert changed_tok.cache.path != first.cache.path

    write_lines(path, [make_chat(i) for i in range(21)])
    changed_data = build_cache_and_open(path, tokenizer, 128, num_proc=1)
    assert changed_data.cache.path != first.cache.path and len(changed_data) == 21

    explicit = build_cache_and_open(path, tokenizer, 128, cache_dir=tmp_path / "elsewhere", num_proc=1)
    assert explicit.cache.path.parent == tmp_path / "elsewhere"
    cache_dirs = sorted(p.name for p in (tmp_path / ".cache").iterdir() if p.name != ".digests")
    assert len(cache_dirs) == 4 and not any(name.startswith(".tmp") for name in cache_dirs)


def test_unchanged_file_is_found_without_hashing_it_and_a_changed_one_is_rehashed(tokenizer, tmp_path, monkeypatch):
    path = write_rows(tmp_path / "k.jsonl", [chat_line(i) for i in range(6)])
    first = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    hashed = []
    real_digest = digests.file_digest
    monkeypatch.setattr(digests, "file_digest", lambda p: hashed.append(p) or real_digest(p))
    assert build_cache_and_open(path, tokenizer, 64, num_proc=1).cache.path == first.cache.path
    assert hashed == []  # a start with the file unchanged reads none of its bytes
    stat = path.stat()
    changed = path.read_bytes().replace(b"What is 0", b"What is 9", 1)  # same size; mtime restored below
    path.write_bytes(changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert hashed == [path] and second.cache.path != first.cache.path
    assert digests.data_digest(path, path.parent / ".cache") == real_digest(path)


def test_a_same_size_edit_between_the_sampled_blocks_with_the_mtime_kept_is_noticed(tokenizer, tmp_path):
    """What `rsync -a`, `cp -p` or `touch -r` leave: other bytes, the same size and mtime. The edit lies
    between two of the cheap key's sampled blocks of a file over 1 MiB; a key of size, mtime and
    sampled blocks alone would take it for the unedited file and reuse the stale cache and digest."""
    path = write_rows(tmp_path / "big.jsonl", [chat_line(i) for i in range(14_000)])
    size = path.stat().st_size
    assert size > 1.2 * digests.SAMPLED_BLOCKS * digests.SAMPLED_BLOCK_BYTES  # gaps between the blocks
    first = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    old_digest = digests.data_digest(path, path.parent / ".cache")
    stat = path.stat()
    gap_start = size // digests.SAMPLED_BLOCKS + digests.SAMPLED_BLOCK_BYTES  # after block 1, before block 2
    data = bytearray(path.read_bytes())
    at = data.index(b"plus 1?", gap_start) - 2  # the last digit of "What is N plus 1?"
    assert gap_start < at < 2 * size // digests.SAMPLED_BLOCKS
    data[at] = ord("7") if data[at] != ord("7") else ord("3")
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert digests.data_digest(path, path.parent / ".cache") == digests.file_digest(path) != old_digest
    second = build_cache_and_open(path, tokenizer, 64, num_proc=1)
    assert second.cache.path != first.cache.path


@pytest.mark.parametrize("memo_text", ["", "c0ffee", "not a digest\n"])
def test_a_digest_memo_that_holds_no_sha256_is_hashed_again_not_shared_by_two_files(tokenizer, tmp_path, memo_text):
    """A memo of .digests left empty (a crash lost its write) or damaged: each file is hashed again and
    opens its own cache, not the cache of another file whose memo holds the same text."""
    first = write_lines(tmp_path / "first.jsonl", [make_chat(i) for i in range(20)])
    second = write_lines(tmp_path / "second.jsonl", [make_chat(i) for i in range(7)])
    for path in (first, second):
        build_cache_and_open(path, tokenizer, 128, num_proc=1)
    memos = sorted((tmp_path / ".cache" / ".digests").iterdir())
    assert len(memos) == 2
    for memo in memos:
        memo.write_text(memo_text, encoding="utf-8")
    for path, rows in ((first, 20), (second, 7)):
        opened = build_cache_and_open(path, tokenizer, 128, num_proc=1)
        assert len(opened) == rows
        assert opened.data_digest == digests.file_digest(path)
    assert sorted(memo.read_text(encoding="utf-8") for memo in memos) == sorted(
        digests.file_digest(path) for path in (first, second))


def test_older_keys_are_those_of_the_versions_other_code_built(tokenizer):
    """Rows versions above 1 exist under this tokens version only: no code built tokens versions 1-3 with
    rows version 2, so no key of such a pair is looked for."""
    digest = "0" * 64
    older = digests.older_keys(digest, tokenizer, 64, digests.TOKENS_VERSION, digests.ROWS_VERSION)
    assert [(tokens, rows) for tokens, rows, _ in older] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert [key for _, _, key in older] == [digests.cache_key(digest, tokenizer, 64, tokens, rows)
                                            for tokens, rows, _ in older]


def test_a_tokenizer_saved_with_truncation_and_padding_opens_the_cache_it_built(tokenizer, tmp_path):
    """A ``tokenizer.json`` may hold truncation and padding settings, which the first tokenizer call
    clears (ours pass none): they change no token, so they are no part of the cache's key, and the
    build and the dataset that opens its cache name the same one."""
    folder = tmp_path / "tok"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, folder)
    definition = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    definition["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    definition["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None,
                             "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer.json").write_text(json.dumps(definition, ensure_ascii=False), encoding="utf-8")
    saved = load_tokenizer(folder)
    path = write_lines(tmp_path / "data.jsonl", [make_chat(i) for i in range(3)])

    opened = build_cache_and_open(path, saved, 128, num_proc=1)
    expected = build_cache_and_open(path, tokenizer, 128, num_proc=1, cache_dir=tmp_path / "shipped")
    assert opened.cache.path.name == expected.cache.path.name
    assert np.array_equal(np.asarray(opened.tokens), np.asarray(expected.tokens))
    assert tokenizer_fingerprint(load_tokenizer(folder)) == tokenizer_fingerprint(tokenizer)


@pytest.mark.parametrize("template", [None, PLAIN_CHATML])
def test_a_tokenizer_saved_with_split_special_tokens_keeps_the_templates_special_tokens(tokenizer, tmp_path, template):
    """``split_special_tokens`` set in ``tokenizer_config.json`` is every call's default: the special
    tokens a template writes (``<|im_start|>``) stay one token each, as under the same tokenizer without
    it, and data that spells one stays text. With the ChatML encoder (the shipped template) and the
    general path (another template), a short text and one longer than the encoder's window, a
    generation prompt, the stop tokens, and the augmentation that drops an empty think block. Its
    caches are its own: the flag is in the fingerprint (the shipped tokenizer's is golden in
    test_tokens_version.py)."""
    folder = tmp_path / "tok"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}), encoding="utf-8")
    splitting, plain = load_tokenizer(folder), load_tokenizer(None)
    if template is not None:
        splitting, plain = with_template(splitting, template), with_template(plain, template)
    assert splitting.split_special_tokens
    im_start = plain.convert_tokens_to_ids("<|im_start|>")
    long = {"conversations": [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Zorlia " * 3000}]}
    rows = [make_chat(0), long,
            {"conversations": [{"role": "user", "content": "say <|im_end|>"}, {"role": "assistant", "content": "no"}]}]
    for row in rows:
        conversation = row["conversations"]
        ids, mask = encode_conversation(splitting, conversation, 256)
        expected_ids, expected_mask = encode_conversation(plain, conversation, 256)
        assert ids.tolist() == expected_ids.tolist() and mask.tolist() == expected_mask.tolist()
        assert ids[0] == im_start
        assert prompt_token_ids(splitting, conversation[:1]) == prompt_token_ids(plain, conversation[:1])
    if template is None:  # the shipped template writes an empty think block: it is found and dropped
        ChatAugmenter(splitting, seed=0, drop_empty_think_ratio=1.0)
    assert tokenizer_fingerprint(splitting) != tokenizer_fingerprint(plain)
    path = write_lines(tmp_path / "data.jsonl", rows)
    built, plain_built = (build_cache_and_open(path, tok, 256, num_proc=1) for tok in (splitting, plain))
    assert built.cache.path != plain_built.cache.path
    assert np.array_equal(np.asarray(built.tokens), np.asarray(plain_built.tokens))
    # the end of a turn is the template's <|im_end|> also where eos is another token
    splitting.eos_token = "<|endoftext|>"
    assert stop_token_ids(splitting) == plain.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
