"""The token cache's key follows the code that decides the tokens (TOKENS_VERSION).

A cache is reused whenever its key matches. The key holds the data's sha256, the tokenizer's
fingerprint and ``max_seq_len``, but the code that turns a row into tokens and labels (parsing,
rendering, truncation) changed without changing it, so a cache built before tool calls and
reasoning were rendered was reused and trained without them. ``TOKENS_VERSION`` is now part of
the key and of ``meta.json``; the golden digest below fails whenever the tokens or labels of fixed
conversations change while it stays the same.
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import dataset.cache.key as digests
import dataset.cache.build as token_cache
from dataset import SFTDataset, build_cache_and_open
from dataset.rendering import tokenizer_fingerprint
from tests.helpers.chat_rows import chat_line, write_rows

GOLDEN_ROWS = Path(__file__).with_name("golden_rows.jsonl")
GOLDEN_MAX_SEQ_LEN = 512
# TOKENS_VERSION -> (fingerprint of the shipped tokenizer, sha256 of the samples of golden_rows.jsonl).
# 2 and 3 gave the same samples with the tokenizer shipped until 2026-11-24 (fingerprint fd9a7e13...,
# samples 4e2daa39...; the golden rows hold none of what 3 changed, see test_tools_and_reasoning.py,
# test_formats.py and test_sources.py); 3 is recorded with today's tokenizer (Qwen2's pre-tokenizer).
# 3 and 4 give the same samples: the golden rows spell no special token in a JSON key, and the
# shipped tokenizer's pieces are proven (4's changes are tested in test_special_keys.py and test_pieces.py).
GOLDEN = {
    2: ("fd9a7e13ec188e2401fb6696d2abaf6af75ae32a57d520bc5d0221437c708346",
        "4e2daa391d9bdc6c815a29c0010ea2981cc8f6c324da597d5562ed208761cd2e"),
    3: ("610e7d212f2ed5cb529da75396ffff44777e24f2cc8aefd1b814fad4d846dfd7",
        "ddc8c067954c13767fa1809188df8fa90904b2fe6fcf40e15c081990c2599b2f"),
    4: ("610e7d212f2ed5cb529da75396ffff44777e24f2cc8aefd1b814fad4d846dfd7",
        "ddc8c067954c13767fa1809188df8fa90904b2fe6fcf40e15c081990c2599b2f"),
}


def samples_digest(ds: SFTDataset) -> str:
    """sha256 of every sample's input_ids and labels, and of what was skipped and dropped."""
    digest = hashlib.sha256()
    for i in range(len(ds)):
        item = ds[i]
        digest.update(json.dumps([item["input_ids"].tolist(), item["labels"].tolist()]).encode())
    digest.update(json.dumps([ds.num_skipped, ds.num_dropped]).encode())
    return digest.hexdigest()


def test_the_tokens_of_fixed_conversations_are_those_recorded_for_this_tokens_version(tokenizer, tmp_path):
    """Demo conversations (tool definitions, tool calls and results, reasoning, multi-turn) and
    OpenAI / ShareGPT rows, text that spells special tokens, replies cut at max_seq_len (English,
    Chinese, digits), a row dropped after truncation, a blank and two bad rows: built into a cache
    (so through the line reading, the parser, the renderer, the truncation and the chunk encoder)."""
    data = tmp_path / "golden.jsonl"
    shutil.copy(GOLDEN_ROWS, data)
    ds = build_cache_and_open(data, tokenizer, GOLDEN_MAX_SEQ_LEN, bad_data="skip", num_proc=1)
    assert (len(ds), ds.num_skipped, ds.num_dropped) == (14, 2, 1)
    assert int(ds.lengths.max()) == GOLDEN_MAX_SEQ_LEN  # some rows are truncated
    fingerprint, digest = tokenizer_fingerprint(tokenizer), samples_digest(ds)
    version = token_cache.TOKENS_VERSION
    assert version in GOLDEN, f"record the digest of TOKENS_VERSION {version}: {version}: ({fingerprint!r}, {digest!r})"
    golden_fingerprint, golden_digest = GOLDEN[version]
    if fingerprint != golden_fingerprint:
        pytest.fail("the shipped tokenizer changed (its fingerprint is in the cache key already, so no new "
                    f"TOKENS_VERSION is needed for it): record {version}: ({fingerprint!r}, {digest!r})")
    assert digest == golden_digest, (
        "the tokens or labels of tests/dataset/golden_rows.jsonl changed while dataset.cache.key.TOKENS_VERSION "
        f"stayed {version}: caches built by the old code would be reused. Raise TOKENS_VERSION, say what changed in "
        f"TOKENS_CHANGES, and record {version + 1}: ({fingerprint!r}, {digest!r}) here")


def legacy_key(data: Path, tokenizer, max_seq_len: int) -> str:
    """The key every build used before tokens were versioned: sha256 of v1|data sha256|tokenizer|max_seq_len."""
    parts = ["v1", digests.file_digest(data), tokenizer_fingerprint(tokenizer), str(max_seq_len)]
    return hashlib.sha256("|".join(parts).encode("utf-8")).hexdigest()[:24]


def test_a_cache_built_by_older_code_is_not_reused(tokenizer, tmp_path, capsys):
    """A cache at the old key (what every build wrote before) holding what older code made of the
    rows (here: the same tokens without a single loss token, as a cache built before the rendering
    learned the tool calls is without them) is left alone; a new one is built and a line says why."""
    data = tmp_path / "d.jsonl"
    shutil.copy(GOLDEN_ROWS, data)
    fresh = build_cache_and_open(data, tokenizer, 64, bad_data="skip", cache_dir=tmp_path / "fresh", num_proc=1)
    cache_root = tmp_path / "cache"
    stale = cache_root / legacy_key(data, tokenizer, 64)
    shutil.copytree(fresh.cache.path, stale)
    (stale / "loss_mask.bin").write_bytes(bytes(len((stale / "loss_mask.bin").read_bytes())))
    meta = json.loads((stale / "meta.json").read_text(encoding="utf-8"))
    meta.pop("tokens_version", None)
    (stale / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    capsys.readouterr()

    ds = build_cache_and_open(data, tokenizer, 64, bad_data="skip", cache_dir=cache_root, num_proc=1)
    assert ds.cache.path != stale  # reusing it would make every label -100
    assert all(np.array_equal(ds[i]["labels"], fresh[i]["labels"]) for i in range(len(fresh)))
    assert (f"d.jsonl: not reusing the token cache {stale}: it was built by older code (tokens version 1; this "
            f"code tokenizes as version {token_cache.TOKENS_VERSION}: ") in capsys.readouterr().err
    assert (stale / "meta.json").is_file()  # older code may still use it
    assert json.loads((ds.cache.path / "meta.json").read_text(encoding="utf-8"))["tokens_version"] == \
        token_cache.TOKENS_VERSION


def test_a_cache_that_records_another_tokens_version_is_built_again(tokenizer, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    shutil.copy(GOLDEN_ROWS, data)
    first = build_cache_and_open(data, tokenizer, 64, bad_data="skip", num_proc=1)
    expected = [first[i]["labels"] for i in range(len(first))]
    meta_path = first.cache.path / "meta.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["tokens_version"] = token_cache.TOKENS_VERSION - 1
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    (first.cache.path / "loss_mask.bin").write_bytes(bytes(len((first.cache.path / "loss_mask.bin").read_bytes())))
    del first
    capsys.readouterr()

    again = build_cache_and_open(data, tokenizer, 64, bad_data="skip", num_proc=1)
    assert (f"d.jsonl: the token cache {again.cache.path} records tokens version {token_cache.TOKENS_VERSION - 1}, "
            f"not this code's {token_cache.TOKENS_VERSION}: building it again") in capsys.readouterr().err
    assert all(np.array_equal(again[i]["labels"], expected[i]) for i in range(len(again)))
    assert json.loads((again.cache.path / "meta.json").read_text(encoding="utf-8"))["tokens_version"] == \
        token_cache.TOKENS_VERSION
    assert [p.name for p in again.cache.path.parent.iterdir() if p.name.startswith(".removed-")] == []


def test_a_cache_built_by_the_parser_before_its_fixes_is_not_reused(tokenizer, tmp_path, monkeypatch):
    # Version 2 parsed '<think>' tags, NaN and parquet nulls otherwise: its caches hold other tokens.
    path = write_rows(tmp_path / "a.jsonl", [chat_line(i) for i in range(3)])
    with monkeypatch.context() as patch:
        patch.setattr(token_cache, "TOKENS_VERSION", 2)
        old = build_cache_and_open(path, tokenizer, 64, num_proc=1).cache.path
    built = []
    real_build = token_cache.build_cache
    monkeypatch.setattr(token_cache, "build_cache", lambda *args: built.append(args) or real_build(*args))
    assert build_cache_and_open(path, tokenizer, 64, num_proc=1).cache.path != old and built
