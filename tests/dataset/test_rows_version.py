"""Which rows a token cache holds follows the rules that decide which rows are bad (ROWS_VERSION).

TOKENS_VERSION stands for the tokens and labels of the rows a cache holds (test_tokens_version.py).
Which rows it holds changes without them: a rule that makes a row bad (a key twice in one JSON
object, a tool call of type 'custom') or keeps one (a repeated turn under Qwen3's template) leaves
every accepted row's tokens as they were, and a cache built under other rules held rows this code
refuses, or lacked rows it keeps. ``ROWS_VERSION`` is part of the cache key and of ``meta.json``:
such a cache is built again, once. The bad lines of fixed rows recorded per version below fail when
they change while it stays the same.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import dataset.cache.build as build
from dataset import build_cache_and_open
from dataset.cache.key import ROWS_CHANGES, file_digest
from dataset.rendering import tokenizer_fingerprint
from dataset.sources import open_lines
from dataset.tokens import encode_conversations
from tests.helpers.cache_checks import plant_rows_1_cache
from tests.helpers.chat_rows import KEY_TWICE, KEY_TWICE_READ_AS_LAST_VALUE, write_lines
from tests.helpers.templates import PLAIN_CHATML, QWEN3_TEMPLATE, with_template

RULES_ROWS = Path(__file__).with_name("rules_rows.jsonl")
# ROWS_VERSION -> the bad lines of rules_rows.jsonl (at max_seq_len 256) with the shipped template, a
# ChatML template of roles and contents only, and Qwen3's. Version 1 holds what the code of the rules
# every cache without a recorded rows version was built under made of them (run on that code).
# Lines: 1 a chat; 2 a key twice; 3 a key twice in a call's arguments string; 4 both 'conversations'
# and 'messages'; 5 a non-empty 'functions'; 6 a call in flat and nested form; 7 a call of type
# 'custom'; 8 a 'type' inside a call's 'function'; 9 a null 'conversations' beside 'messages'; 10 an
# empty 'messages' beside 'conversations'; 11 a null flat 'name' beside a nested 'function'; 12 tools
# and a tool call; 13 reasoning; 14 a last reply that repeats an earlier turn; 15 not JSON; 16 NaN;
# 17 no conversation.
BAD_LINES = {
    1: {"shipped": [9, 15, 16, 17], "plain ChatML": [9, 15, 16, 17], "Qwen3": [9, 14, 15, 16, 17]},
    2: {"shipped": [2, 3, 4, 5, 6, 7, 8, 15, 16, 17], "plain ChatML": [2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 15, 16, 17],
        "Qwen3": [2, 3, 4, 5, 6, 7, 8, 15, 16, 17]},
}


def bad_lines(tokenizer, path: Path, max_seq_len: int) -> list[int]:
    """The lines of ``path`` the build's chunk function (parsing, then encoding) finds bad."""
    lines = list(open_lines(path))
    result = build.encode_chunk((1, lines, max_seq_len), lambda rows, cut: encode_conversations(tokenizer, rows, cut))
    return [number for number, _ in result["bad"]]


def test_the_bad_lines_of_fixed_rows_are_those_recorded_for_this_rows_version(tokenizer):
    templates = {"shipped": tokenizer, "plain ChatML": with_template(tokenizer, PLAIN_CHATML),
                 "Qwen3": with_template(tokenizer, QWEN3_TEMPLATE)}
    found = {name: bad_lines(template, RULES_ROWS, 256) for name, template in templates.items()}
    version = build.ROWS_VERSION
    assert found == BAD_LINES.get(version), (
        f"the bad lines of tests/dataset/rules_rows.jsonl are not those recorded for ROWS_VERSION {version}: caches "
        f"built under other rules would be reused. Raise ROWS_VERSION, say what changed in ROWS_CHANGES, and record "
        f"{version + 1}: {found} here")


CHAT = {"conversations": [{"role": "user", "content": "Capital of Zorlia?"}, {"role": "assistant", "content": "Velm"}]}


def test_a_cache_built_under_other_rules_of_bad_rows_is_built_again_once(tokenizer, tmp_path, capsys):
    """A cache of rows version 1 (where a key twice in one JSON object was read as its last value) at
    the key every cache of tokens version 4 had is left in place; a new one without that row is built
    once, and a line says why."""
    data = write_lines(tmp_path / "d.jsonl", [CHAT, KEY_TWICE, CHAT])
    cache_root = tmp_path / "cache"
    old = plant_rows_1_cache(data, [CHAT, KEY_TWICE_READ_AS_LAST_VALUE, CHAT], cache_root, 64)
    key_without_rows = "|".join(["v1", file_digest(data), tokenizer_fingerprint(tokenizer), "64", "tokens4"])
    assert old.name == hashlib.sha256(key_without_rows.encode("utf-8")).hexdigest()[:24]
    capsys.readouterr()

    ds = build_cache_and_open(data, tokenizer, 64, bad_data="skip", cache_dir=cache_root, num_proc=1)
    assert capsys.readouterr().err.splitlines()[0] == (
        f"d.jsonl: not reusing the token cache {old}: it was built by older code (rows version 1; this code accepts "
        f"rows as version 2: {ROWS_CHANGES[2]}); building a new one (delete the old one once no older minisft uses "
        "it)")
    assert ds.cache.path != old and (len(ds), ds.num_skipped) == (2, 1)
    assert json.loads((old / "meta.json").read_text(encoding="utf-8"))["num_samples"] == 3  # left for older code
    assert json.loads((ds.cache.path / "meta.json").read_text(encoding="utf-8"))["rows_version"] == 2
    again = build_cache_and_open(data, tokenizer, 64, bad_data="skip", cache_dir=cache_root, num_proc=1)
    assert again.cache.path == ds.cache.path and capsys.readouterr().err == ""


@pytest.mark.parametrize("recorded", [None, 1])
def test_a_cache_that_records_another_or_no_rows_version_is_built_again(tokenizer, tmp_path, capsys, recorded):
    data = write_lines(tmp_path / "d.jsonl", [CHAT, CHAT])
    first = build_cache_and_open(data, tokenizer, 64, num_proc=1)
    expected = [first[i]["labels"] for i in range(len(first))]
    meta = json.loads((first.cache.path / "meta.json").read_text(encoding="utf-8"))
    meta.pop("rows_version")
    meta.update({} if recorded is None else {"rows_version": recorded})
    (first.cache.path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    (first.cache.path / "loss_mask.bin").write_bytes(bytes(len((first.cache.path / "loss_mask.bin").read_bytes())))
    capsys.readouterr()

    again = build_cache_and_open(data, tokenizer, 64, num_proc=1)
    assert capsys.readouterr().err.splitlines()[0] == (
        f"d.jsonl: the token cache {again.cache.path} records rows version 1, not this code's 2: building it again")
    assert again.cache.path == first.cache.path
    assert all(np.array_equal(again[i]["labels"], expected[i]) for i in range(len(again)))
    assert json.loads((again.cache.path / "meta.json").read_text(encoding="utf-8"))["rows_version"] == 2
