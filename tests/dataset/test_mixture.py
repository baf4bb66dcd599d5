"""Data mixtures (--data_path a.jsonl:3,shards/,'data/*.jsonl.gz'): parsing, counts per epoch,
a world-size independent and resumable stream, per-source losses (docs/data.md)."""

import gzip
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dataset import DataError, ResumableDistributedSampler, SFTCollator, load_tokenizer
from dataset.mixture import EpochMixture, epoch_counts, parse_data_path
from model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.trainer_launch import (TINY, checkpoint_at, final_weights, flags, run_trainer, run_trainer_in_process,
                                         together)
from trainer.args import parse_args
from trainer.data_setup import build_train_data
from trainer.run_logger import format_figure
from trainer.loop.source_losses import SourceLosses


def source_of(mixture: EpochMixture, indices: np.ndarray) -> np.ndarray:
    """The source of each sample index (the sources laid end to end from ``mixture.starts``)."""
    return np.searchsorted(mixture.starts, indices, side="right") - 1


def per_source(order: np.ndarray, mixture: EpochMixture) -> list[np.ndarray]:
    sources = source_of(mixture, order)
    return [order[sources == s] - mixture.starts[s] for s in range(len(mixture.sizes))]


# --------------------------------------------------------------------------- counts per epoch


def test_counts_per_epoch_repeat_a_small_source_and_take_changing_subsets_of_a_big_one():
    mixture = EpochMixture([10, 50], [3, 1], seed=5)
    assert mixture.counts == [45, 15]  # 60 samples per epoch, split 3:1
    sampler = ResumableDistributedSampler(60, 1, 0, seed=5, mixture=mixture)
    subsets = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        small, big = per_source(sampler.global_order(), mixture)
        assert (len(small), len(big)) == (45, 15)
        # 4 full passes over the small source plus 5 rows of its seeded cycle
        assert sorted(np.bincount(small, minlength=10).tolist()) == [4] * 5 + [5] * 5
        assert len(set(big.tolist())) == 15  # a subset: no row twice
        subsets.append(set(big.tolist()))
    assert subsets[0] != subsets[1]
    assert len(subsets[0] | subsets[1] | subsets[2]) == 45  # epochs take the cycle's next rows
    assert subsets[0] | subsets[1] | subsets[2] | subsets[3] == set(range(50))  # all rows used


def test_counts_are_the_largest_remainder_split_and_one_source_is_the_plain_stream():
    assert epoch_counts([7, 5, 3], [1, 2.5, 0.5]) == [4, 9, 2]  # quotas 3.75, 9.375, 1.875
    assert epoch_counts([1, 1, 1], [1, 1, 1]) == [1, 1, 1]
    assert epoch_counts([2, 1], [1, 1]) == [2, 1]  # 1.5 each: the tie goes to the first source
    single = ResumableDistributedSampler(30, 1, 0, seed=2, mixture=EpochMixture([30], [3.0], seed=2))
    assert single.global_order().tolist() == ResumableDistributedSampler(30, 1, 0, seed=2).global_order().tolist()


@pytest.mark.parametrize("group_size", [None, 8])
def test_the_mixture_stream_is_the_same_for_1_2_and_4_ranks_and_resumes_on_any(group_size):
    lengths = torch.randint(5, 300, (70,), generator=torch.Generator().manual_seed(1)).numpy()
    mixture = EpochMixture([10, 60], [3, 1], seed=9)

    def stream(world_size: int, epoch: int, start: int = 0) -> list[int]:
        shards = [ResumableDistributedSampler(70, world_size, rank, seed=9, lengths=lengths, group_size=group_size,
                                              mixture=mixture, epoch=epoch, start_index=start)
                  for rank in range(world_size)]
        return [index for column in zip(*(list(shard) for shard in shards)) for index in column]

    for epoch in (0, 1):
        one = stream(1, epoch)
        assert stream(2, epoch) == one and stream(4, epoch)[:70] == one
        assert stream(4, epoch, start=24)[:46] == one[24:] and stream(2, epoch, start=24) == one[24:]
        assert sorted(source_of(mixture, np.asarray(one)).tolist()) == [0] * 53 + [1] * 17  # counts of 70 at 3:1


# --------------------------------------------------------------------------- sources


def chat(i: int) -> dict:
    return {"conversations": [{"role": "user", "content": f"What is {i} plus 1?"},
                              {"role": "assistant", "content": str(i + 1)}]}


def write_rows(path, rows) -> None:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def train_data(data_path: str, cache_dir, *extra):
    args = parse_args([*TINY, "--data_path", data_path, "--cache_dir", str(cache_dir), *extra])
    return build_train_data(args, load_tokenizer(None), SimpleNamespace(world_size=1, rank=0, local_rank=0, device=torch.device("cpu")))


def test_a_directory_or_glob_source_holds_the_same_samples_as_listing_its_files(tmp_path, monkeypatch):
    import dataset.cache.build as token_cache

    shards = tmp_path / "shards"
    shards.mkdir()
    write_rows(shards / "part-0.jsonl", [chat(i) for i in range(5)])
    write_rows(shards / "part-1.jsonl.gz", [chat(i) for i in range(5, 8)])
    (shards / "README.md").write_text("not data")
    listed = train_data(f"{shards / 'part-0.jsonl'},{shards / 'part-1.jsonl.gz'}", tmp_path / "cache").dataset
    # every file has its own cache, keyed as a single file's: regrouping the files tokenizes nothing again
    monkeypatch.setattr(token_cache, "build_cache", lambda *args: pytest.fail("tokenized again"))
    for spec, name in ((str(shards), "shards"), (str(shards / "part-*"), "part")):
        source = train_data(spec, tmp_path / "cache").dataset
        assert source.names == [name] and len(source) == len(listed) == 8
        for index in range(8):
            mine, theirs = source[index], listed[index]
            assert np.array_equal(mine["input_ids"], theirs["input_ids"]) and mine["source"] == 0
    assert [path.name for path in parse_data_path(str(shards))[0].files] == ["part-0.jsonl", "part-1.jsonl.gz"]


def test_a_directory_reads_json_and_upper_case_shards_and_names_its_subdirectories(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    (shards / "more").mkdir(parents=True)
    (shards / ".cache").mkdir()
    write_rows(shards / "a.JSONL", [chat(i) for i in range(2)])
    write_rows(shards / "b.json", [chat(i) for i in range(2, 5)])  # a .json shard: JSON Lines as well
    (shards / "c.Jsonl.GZ").write_bytes(gzip.compress((json.dumps(chat(5)) + "\n").encode()))
    pq.write_table(pa.Table.from_pylist([chat(6), chat(7)]), shards / "d.PARQUET")
    write_rows(shards / "more" / "e.jsonl", [chat(8)])  # a subdirectory: not read, named
    write_rows(shards / ".cache" / "f.jsonl", [chat(9)])  # a hidden one (token caches): not read
    (shards / "notes.txt").write_text("not data")
    source = parse_data_path(str(shards))[0]
    assert [path.name for path in source.files] == ["a.JSONL", "b.json", "c.Jsonl.GZ", "d.PARQUET"]
    assert [path.name for path in source.ignored] == ["more", "notes.txt"]
    assert [s.name for s in parse_data_path(f"{shards / 'a.JSONL'},{shards / 'd.PARQUET'}")] == ["a", "d"]
    built = train_data(str(shards), tmp_path / "cache")
    assert len(built.dataset) == 8
    assert (f"[data] {shards}: left out 2 entries that are not data files or are subdirectories: more/, notes.txt"
            in capsys.readouterr().out)
    assert built.identity.sources[0].left_out == (str(shards / "more"), str(shards / "notes.txt"))  # in the run's record
    # A glob names a directory it matches (its files are not read) as well.
    assert [path.name for path in parse_data_path(str(shards / "*"))[0].ignored] == ["more", "notes.txt"]
    # Every file of a subdirectory: a ** glob; a directory of subdirectories only points to it.
    assert [path.name for path in parse_data_path(str(shards / "**" / "*.jsonl"))[0].files] == ["e.jsonl"]
    (tmp_path / "tree" / "train").mkdir(parents=True)
    write_rows(tmp_path / "tree" / "train" / "a.jsonl", [chat(1)])
    with pytest.raises(DataError, match=r"tree: directory holds no data files .*\(subdirectories are not read: use a "
                                        r"glob such as '.*tree/\*\*/\*\.jsonl'\)$"):
        parse_data_path(str(tmp_path / "tree"))


def test_a_json_shard_must_be_json_lines(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_rows(shards / "a.jsonl", [chat(1)])
    (shards / "b.json").write_text(json.dumps([chat(2), chat(3)], indent=1), encoding="utf-8")
    with pytest.raises(DataError, match=r"b\.json: is one JSON array, not JSON Lines .* jq -c '\.\[\]'"):
        train_data(str(shards), tmp_path / "cache")
    (shards / "b.json").write_text(json.dumps({"dataset": "info", "rows": 3}, indent=2), encoding="utf-8")
    with pytest.raises(DataError, match=r"b\.json: is one JSON document spread over several lines, not JSON Lines"):
        train_data(str(shards), tmp_path / "cache")


def test_bad_sources_and_weights_are_named_in_one_line(tmp_path):
    write_rows(tmp_path / "a.jsonl", [chat(1)])
    (tmp_path / "empty").mkdir()
    write_rows(tmp_path / "odd:2", [chat(2)])  # a path that exists as written is not split at its colon
    assert [(s.name, s.weight) for s in parse_data_path(f"{tmp_path / 'odd:2'},{tmp_path / 'a.jsonl'}:0.5")] == [
        ("odd:2", 1.0), ("a", 0.5)]
    cases = {
        f"{tmp_path / 'missing.jsonl'}": f"{tmp_path / 'missing.jsonl'}: data file not found",
        f"{tmp_path / 'empty'}": f"{tmp_path / 'empty'}: directory holds no data files (.jsonl, .jsonl.gz, .json, "
                                 ".json.gz, .parquet)",
        f"{tmp_path / '*.parquet'}": f"--data_path {tmp_path / '*.parquet'}: no data file (.jsonl, .jsonl.gz, .json, "
                                     ".json.gz, .parquet) matches this glob",
        f"{tmp_path / 'a.jsonl'}:0": f"--data_path {tmp_path / 'a.jsonl'}:0: the weight '0' after ':' must be a "
                                     f"positive number (e.g. {tmp_path / 'a.jsonl'}:2)",
        f"{tmp_path / 'a.jsonl'}:-1": "the weight '-1' after ':' must be a positive number",
        f"{tmp_path / 'a.jsonl'}:nan": "the weight 'nan' after ':' must be a positive number",
        f"{tmp_path / 'a.jsonl'}:heavy": "the weight 'heavy' after ':' must be a positive number",
        " , ": "--data_path is empty",
    }
    for spec, message in cases.items():
        with pytest.raises(DataError) as caught:
            parse_data_path(spec)
        assert message in str(caught.value) and "\n" not in str(caught.value), spec
    result = run_trainer_in_process([*TINY, "--data_path", f"{tmp_path / 'a.jsonl'}:0", "--save_dir",
                                     str(tmp_path / "run")])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"error: --data_path {tmp_path / 'a.jsonl'}:0: the weight '0' "
                                                      f"after ':' must be a positive number (e.g. {tmp_path / 'a.jsonl'}:2)")


def test_a_malformed_row_in_a_shard_names_the_shard_and_row(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_rows(shards / "a.jsonl", [chat(i) for i in range(3)])
    write_rows(shards / "b.jsonl.gz", [chat(1), chat(2), {"conversations": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(DataError) as caught:
        train_data(f"{tmp_path / 'shards'}:2", tmp_path / "cache")
    assert str(caught.value).startswith(f"{shards / 'b.jsonl.gz'}:3: ")


def test_with_packing_each_source_is_packed_into_rows_of_its_own(tmp_path):
    write_rows(tmp_path / "a.jsonl", [chat(i) for i in range(6)])
    write_rows(tmp_path / "b.jsonl", [chat(i) for i in range(20, 29)])
    data = train_data(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}:2", tmp_path / "cache", "--packing", "1")
    dataset = data.dataset
    assert [len(part) for part in dataset.parts] == [1, 1]  # short chats: each source fits one row
    assert [dataset[i]["source"] for i in range(2)] == [0, 1]
    assert (dataset[0]["position_ids"] == 0).sum() == 6 and (dataset[1]["position_ids"] == 0).sum() == 9
    assert data.sampler.mixture.counts == [1, 1]  # rows are what the weights count


def test_the_resume_fingerprint_uses_the_token_caches_digests_not_a_new_hash(tmp_path, monkeypatch):
    import hashlib

    import dataset.cache.key as digests

    write_rows(tmp_path / "a.jsonl", [chat(i) for i in range(4)])
    train_data(str(tmp_path / "a.jsonl"), tmp_path / "cache")  # builds the cache, memoizes the digest

    def no_hashing(path):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(digests, "file_digest", no_hashing)
    settings = train_data(str(tmp_path / "a.jsonl"), tmp_path / "cache").identity.legacy_fixed()
    assert settings["--data_path content"] == hashlib.sha256((tmp_path / "a.jsonl").read_bytes()).hexdigest()[:16]
    assert settings["--data_path weights"] == "1"


# --------------------------------------------------------------------------- per-source losses


def test_per_source_losses_are_the_token_losses_and_sum_back_to_the_loss():
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=64)
    model = MiniMindForCausalLM(config)
    items = []
    for row, (length, source) in enumerate([(9, 0), (6, 1), (11, 1)]):
        ids = torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(row)).numpy()
        labels = ids.copy()
        labels[: 2 + row] = -100
        items.append({"input_ids": ids, "labels": labels, "source": source})
    batch = SFTCollator(pad_token_id=0)(items)
    assert batch["loss_sources"].tolist() == [0] * 7 + [1] * 3 + [1] * 7  # per loss position
    tokens = len(batch["loss_positions"])
    model.chunk_lm_loss = True
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], loss_positions=batch["loss_positions"],
                skip_logits=True, num_items_in_batch=tokens, return_token_losses=True)
    flat = model(input_ids=batch["input_ids"]).logits[:, :-1].reshape(-1, 64)
    expected = torch.nn.functional.cross_entropy(flat, batch["labels"][:, 1:].reshape(-1), reduction="none")
    expected = expected[batch["labels"][:, 1:].reshape(-1) != -100]
    assert torch.allclose(out.token_losses, expected, rtol=1e-5, atol=1e-6)
    assert out.token_losses.sum() / tokens == out.loss  # the same values the loss sums

    # Three steps in one window: loss/s weighted by loss_share/s sums back to the mean step loss.
    tracker, step_losses = SourceLosses(["a", "b"], torch.device("cpu")), []
    for step_tokens_scale in (1, 2, 3):
        step_tokens = tokens * step_tokens_scale  # as if other ranks held the rest of the step's tokens
        tracker.add_micro_batch(out.token_losses, batch)
        tracker.end_step(step_tokens, finite=True)
        step_losses.append(float(out.token_losses.sum()) / step_tokens)
    tracker.add_micro_batch(out.token_losses * float("nan"), batch)
    tracker.end_step(tokens, finite=False)  # a skipped step is left out, as from the loss
    figures = tracker.figures()
    assert figures["loss_tokens/a"] == 21 and figures["loss_tokens/b"] == 30
    assert figures["loss/a"] == pytest.approx(float(out.token_losses[:7].mean()), rel=1e-6)
    mean_loss = sum(step_losses) / 3
    assert figures["loss_share/a"] * figures["loss/a"] + figures["loss_share/b"] * figures["loss/b"] == pytest.approx(
        mean_loss, rel=1e-6)
    assert tracker.figures()["loss/a"] is None  # a new window


# --------------------------------------------------------------------------- trainer runs


@pytest.fixture(scope="module")
def mixture_data(data, tmp_path_factory):
    """general.jsonl (60 conversations) and a directory of two shards (.jsonl and .jsonl.gz, 36)."""
    folder = tmp_path_factory.mktemp("mixture")
    lines = open(data / "train.jsonl", encoding="utf-8").readlines()
    (folder / "general.jsonl").write_text("".join(lines[:60]), encoding="utf-8")
    (folder / "tools").mkdir()
    (folder / "tools" / "a.jsonl").write_text("".join(lines[60:80]), encoding="utf-8")
    with gzip.open(folder / "tools" / "b.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(lines[80:96]))
    return folder


def mixture_flags(folder, save_dir, weights=(1, 2), *extra) -> list[str]:
    spec = f"{folder / 'general.jsonl'}:{weights[0]},{folder / 'tools'}:{weights[1]}"
    return [*TINY, "--data_path", spec, "--save_dir", str(save_dir), "--batch_size", "4", "--max_steps", "6",
            "--dropout", "0.1", *extra]


def train_rows(save_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"), encoding="utf-8")]
    timed = ("time", "tokens_per_s", "model_tflops_per_s")  # the clock's, which differ between runs
    return {row["step"]: {k: v for k, v in row.items() if k not in timed}
            for row in rows if row["kind"] == "train"}


def test_a_mixture_resumes_bit_exactly_and_refuses_a_changed_weight(mixture_data, tmp_path):
    run_trainer_in_process(mixture_flags(mixture_data, tmp_path / "full", (1, 2), "--save_interval", "3"), check=True)
    refused, resumed = together(
        lambda: run_trainer_in_process(mixture_flags(mixture_data, tmp_path / "refused", (1, 3), "--resume_from",
                                                     checkpoint_at(tmp_path / "full", 3))),
        lambda: run_trainer(mixture_flags(mixture_data, tmp_path / "resumed", (1, 2), "--save_interval", "0",
                                          "--resume_from", checkpoint_at(tmp_path / "full", 3))))
    assert "[data] mixture per epoch: general 32 of 60 samples (weight 1, 1 file(s)); tools 64 of 36 samples " \
           "(weight 2, 2 file(s))" in resumed.stdout
    full_weights, resumed_weights = final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(full_weights[key], resumed_weights[key]) for key in full_weights)
    full, after = train_rows(tmp_path / "full"), train_rows(tmp_path / "resumed")
    for step in (4, 5, 6):
        assert {k: v for k, v in after[step].items() if k not in ("run_id", "forked_from")} == {
            k: v for k, v in full[step].items() if k != "run_id"}
    for row in full.values():  # one step per window: the token-weighted per-source losses give the loss
        present = [name for name in ("general", "tools") if row[f"loss_tokens/{name}"]]
        assert all(row[f"loss/{name}"] is None for name in {"general", "tools"} - set(present))  # none drawn
        weighted = sum(row[f"loss/{name}"] * row[f"loss_tokens/{name}"] for name in present)
        assert weighted / sum(row[f"loss_tokens/{name}"] for name in present) == pytest.approx(row["loss"], rel=1e-6)
    assert any(all(row[f"loss_tokens/{name}"] for name in ("general", "tools")) for row in full.values())
    progress = f"| general {format_figure(full[6]['loss/general'], '.4f')} tools {format_figure(full[6]['loss/tools'], '.4f')}"
    assert any(line.startswith("step 6/6") and progress in line
               for line in resumed.stdout.splitlines())  # the progress line names the sources' losses

    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "error: cannot resume: --data_path weights differs from the checkpoint's run (checkpoint 1,2, now 1,3), "
        "so its position in the epoch would mean other samples; resume with the same sources and weights "
        f"(--data_path {mixture_data / 'general.jsonl'}:1,{mixture_data / 'tools'}:2)")


@pytest.mark.slow
def test_two_ranks_give_the_same_per_source_losses_and_weights_as_one(mixture_data, tmp_path):
    """The per-source sums are reduced over ranks: 2 ranks x 2 rows report what 1 rank x 4 does."""
    common = ("--max_steps", "3", "--save_interval", "0", "--dropout", "0")
    together(lambda: run_trainer_in_process([*mixture_flags(mixture_data, tmp_path / "one", (1, 2)), *common],
                                            check=True),
             lambda: run_trainer([*mixture_flags(mixture_data, tmp_path / "two", (1, 2)), *common, "--batch_size", "2"],
                                 nproc=2))
    one, two = train_rows(tmp_path / "one"), train_rows(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        for key, value in one[step].items():
            if key.startswith(("loss/", "loss_share/")) and value is None:  # a source with no tokens in this step
                assert two[step][key] is None and one[step][f"loss_tokens/{key.split('/')[1]}"] == 0, (step, key)
            elif key.startswith(("loss/", "loss_share/")):
                assert two[step][key] == pytest.approx(value, rel=1e-5), (step, key)
            elif key.startswith("loss_tokens/"):
                assert two[step][key] == value, (step, key)
    for name in ("general", "tools"):
        assert sum(row[f"loss_tokens/{name}"] for row in one.values()) > 0
    first, second = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert all(torch.allclose(first[key], second[key], atol=1e-5, rtol=0) for key in first)


def test_a_file_read_twice_is_refused_in_one_line(data, tmp_path):
    # Each reading would train on all of the file's rows: twice as often per epoch as the others'.
    shards = tmp_path / "shards"
    shards.mkdir()
    write_rows(shards / "a.jsonl", [chat(i) for i in range(3)])
    write_rows(tmp_path / "b.jsonl", [chat(i) for i in range(3)])
    a, b = shards / "a.jsonl", tmp_path / "b.jsonl"
    advice = "its rows would be trained twice per epoch; give it once (a weight, {}:2, gives a source a larger share " \
             "of a mixture; --epochs adds passes)"
    for spec, where, first in (
            (f"{a},{b},{a}", f"in the sources {a} and {a}", a),
            (f"{shards}:3,{a}", f"in the sources {shards} and {a}", shards),
            (f"{b},{shards / '*.jsonl'},{a}", f"in the sources {shards / '*.jsonl'} and {a}", shards / "*.jsonl")):
        with pytest.raises(DataError) as refused:
            parse_data_path(spec)
        assert str(refused.value) == f"--data_path reads {a} twice, {where}: {advice.format(first)}"
    (shards / "link.jsonl").symlink_to(a)
    with pytest.raises(DataError) as refused:
        parse_data_path(str(shards))
    assert str(refused.value) == (f"--data_path reads {a} twice, in the source {shards}, as {a} and "
                                  f"{shards / 'link.jsonl'}: {advice.format(shards)}")
    assert [source.files for source in parse_data_path(f"{a},{b}")] == [(a,), (b,)]  # apart, each is read once
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--data_path", f"{b},{b}"))
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"error: --data_path reads {b} twice, in the sources {b} and {b}: {advice.format(b)}"])
