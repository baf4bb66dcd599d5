"""A finished token cache with a file cut short: built again by the builder, one line when opened."""

import json
from pathlib import Path

import numpy as np
import pytest

from dataset import DataError, SFTDataset, build_cache_and_open
from dataset.cache import TokenCache

FILES = ("tokens.bin", "loss_mask.bin", "offsets.npy", "meta.json")


def built_cache(tokenizer, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"What is {i} plus 1?"},
                                                          {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                            for i in range(7)), encoding="utf-8")
    cache = build_cache_and_open(data, tokenizer, 64, num_proc=1).cache.path
    return cache, {name: (cache / name).read_bytes() for name in FILES}


def cut(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def expected_problem(name: str, files: dict[str, bytes]) -> str:
    size = len(files[name])
    if name == "meta.json":
        with pytest.raises(json.JSONDecodeError) as parse:
            json.loads(files[name][:-3])
        return f"meta.json is not a cache record (JSONDecodeError: {parse.value})"
    return f"{name} has {size - 3:,} bytes, {size:,} expected"


@pytest.mark.parametrize("name", FILES)
def test_a_cache_file_cut_short_is_built_again(tokenizer, tmp_path, capsys, name):
    cache, files = built_cache(tokenizer, tmp_path)
    cut(cache / name, len(files[name]) - 3)
    capsys.readouterr()
    again = build_cache_and_open(tmp_path / "a.jsonl", tokenizer, 64, num_proc=1)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"a.jsonl: the token cache {cache} is damaged ({expected_problem(name, files)}): building it again"
    assert again.cache.path == cache
    assert {n: (cache / n).read_bytes() for n in FILES} == files


@pytest.mark.parametrize("name", FILES)
def test_opening_a_cache_file_cut_short_is_one_line_naming_what_to_delete(tokenizer, tmp_path, name):
    cache, files = built_cache(tokenizer, tmp_path)
    cut(cache / name, len(files[name]) - 3)
    with pytest.raises(DataError) as info:
        TokenCache(cache)
    assert str(info.value) == (f"the token cache {cache} is damaged: {expected_problem(name, files)}; "
                               f"delete {cache} and run again to build it anew")


def test_offsets_that_do_not_end_at_the_token_count_are_damage(tokenizer, tmp_path):
    cache, files = built_cache(tokenizer, tmp_path)
    offsets = bytearray(files["offsets.npy"])
    offsets[-8:] = (5).to_bytes(8, "little")
    (cache / "offsets.npy").write_bytes(bytes(offsets))
    total = json.loads(files["meta.json"])["num_tokens"]
    with pytest.raises(DataError, match=rf"offsets.npy runs from 0 to 5, from 0 to {total:,} expected; delete"):
        TokenCache(cache)


def test_opening_a_finished_cache_checks_its_files_once(tokenizer, tmp_path, monkeypatch):
    """One open reads ``meta.json`` once and the header of ``offsets.npy`` once: the damage check
    runs in one place (``TokenCache``), not again before it."""
    cache, _ = built_cache(tokenizer, tmp_path)
    reads = []
    real_header, real_read_text = np.lib.format.read_array_header_1_0, Path.read_text
    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", lambda f: reads.append("header") or real_header(f))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self.name) or real_read_text(self, *a, **k))
    opened = SFTDataset(tmp_path / "a.jsonl", tokenizer, 64)
    assert opened.cache.path == cache and len(opened) == 7
    assert sorted(name for name in reads if name in ("header", "meta.json")) == ["header", "meta.json"]


def flip_a_token_past_the_vocabulary(cache: Path, files: dict[str, bytes]) -> tuple[int, int]:
    """tokens.bin with one id set to the dtype's largest (flipped bits, same size); (entry, id)."""
    dtype = np.dtype(json.loads(files["meta.json"])["dtype"])
    tokens = np.frombuffer(files["tokens.bin"], dtype=dtype).copy()
    tokens[5] = np.iinfo(dtype).max
    (cache / "tokens.bin").write_bytes(tokens.tobytes())
    return 5, int(tokens[5])


def test_a_token_id_past_the_vocabulary_is_damage_built_again(tokenizer, tmp_path, capsys):
    cache, files = built_cache(tokenizer, tmp_path)
    entry, token = flip_a_token_past_the_vocabulary(cache, files)
    capsys.readouterr()
    again = build_cache_and_open(tmp_path / "a.jsonl", tokenizer, 64, num_proc=1)
    assert capsys.readouterr().err.splitlines()[0] == (
        f"a.jsonl: the token cache {cache} is damaged (tokens.bin holds token id {token:,} at entry {entry}, outside "
        f"the vocabulary of {len(tokenizer):,}): building it again")
    assert again.cache.path == cache
    assert {n: (cache / n).read_bytes() for n in FILES} == files


def test_opening_a_cache_holding_a_token_id_past_the_vocabulary_is_one_line(tokenizer, tmp_path):
    cache, files = built_cache(tokenizer, tmp_path)
    entry, token = flip_a_token_past_the_vocabulary(cache, files)
    with pytest.raises(DataError) as info:
        TokenCache(cache)
    assert str(info.value) == (f"the token cache {cache} is damaged: tokens.bin holds token id {token:,} at entry "
                               f"{entry}, outside the vocabulary of {len(tokenizer):,}; delete {cache} and run again "
                               "to build it anew")


@pytest.mark.parametrize("left", [("tokens.bin", "loss_mask.bin", "offsets.npy"), ("tokens.bin",), ()])
def test_a_cache_folder_without_meta_json_is_built_again_not_a_write_error_on_every_run(tokenizer, tmp_path, capsys,
                                                                                         left):
    """What a deletion or a copy stopped halfway leaves: the cache's folder with some of its files
    and no meta.json. The build's rename onto it failed ("Directory not empty") on every run."""
    cache, files = built_cache(tokenizer, tmp_path)
    for name in FILES:
        if name not in left:
            (cache / name).unlink()
    capsys.readouterr()
    for _ in range(2):
        again = build_cache_and_open(tmp_path / "a.jsonl", tokenizer, 64, num_proc=1)
        assert again.cache.path == cache and len(again) == 7
        assert {n: (cache / n).read_bytes() for n in FILES} == files
    assert capsys.readouterr().err.splitlines()[0] == (
        f"a.jsonl: the token cache {cache} is damaged (it has no meta.json): building it again")
    assert sorted(path.name for path in cache.parent.iterdir()) == sorted([cache.name, ".digests"])
