"""A resume across a change of the rules that decide which rows are bad (dataset.cache.key.ROWS_VERSION):
the version is not part of the run's identity. The resuming code builds the token cache again under
its rules; a run whose rows stay the same resumes bit for bit, one whose file lost or gained rows is
refused in one line naming its number of samples.

The checkpoint's run is this code with `ROWS_VERSION` 1 (so it opens the cache at the key of rows
version 1), on a cache as code of rows version 1 left it (tests/helpers/cache_checks.py): its
number of samples in the refusal is that cache's."""

import json
import os
from pathlib import Path

import pytest

import dataset.cache.build as build
from tests.helpers.cache_checks import data_key, held_out_entry, plant_rows_1_cache
from tests.helpers.chat_rows import KEY_TWICE, KEY_TWICE_READ_AS_LAST_VALUE, write_lines
from tests.helpers.trainer_launch import (
    TINY, assert_weights_equal, checkpoint_at, eval_rows, final_weights, run_trainer_in_process,
)

DEMO = Path(__file__).resolve().parents[2] / "dataset" / "demo" / "sft_train.jsonl"
USER, REPLY = {"role": "user", "content": "Capital of Zorlia?"}, {"role": "assistant", "content": "Velm"}
# A row that the rules of rows version 2 keep and those of version 1 refused (as this line is refused).
NULL_CONVERSATIONS = {"conversations": None, "messages": [USER, REPLY]}
REFUSED = "{not a row"


def demo_rows(count: int) -> list[str]:
    return DEMO.read_text(encoding="utf-8").splitlines()[:count]


def train(tmp_path, data: Path, save_dir: str, *extra: str):
    return run_trainer_in_process([*TINY, "--batch_size", "2", "--save_interval", "2", "--bad_data", "skip",
                                   "--cache_dir", str(tmp_path / "cache"), "--data_path", str(data), "--save_dir",
                                   str(tmp_path / save_dir), *extra])


def train_under_rows_1(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(build, "ROWS_VERSION", 1)
        return train(*args, **kwargs)


@pytest.mark.parametrize("row, rows_1_reading, before, now", [
    (KEY_TWICE, KEY_TWICE_READ_AS_LAST_VALUE, 31, 30), (NULL_CONVERSATIONS, REFUSED, 30, 31)], ids=["lost", "gained"])
def test_a_resume_whose_rebuilt_cache_lost_or_gained_rows_is_refused_naming_the_samples(
        tmp_path, monkeypatch, row, rows_1_reading, before, now):
    data = write_lines(tmp_path / "d.jsonl", [*demo_rows(15), row, *demo_rows(15)])
    old = plant_rows_1_cache(data, [*demo_rows(15), rows_1_reading, *demo_rows(15)], tmp_path / "cache")
    train_under_rows_1(monkeypatch, tmp_path, data, "run", "--max_steps", "2").check_returncode()

    resumed = train(tmp_path, data, "run2", "--max_steps", "4", "--resume_from", checkpoint_at(tmp_path / "run", 2))
    assert resumed.returncode == 2, resumed.stderr
    assert f"d.jsonl: not reusing the token cache {old}: it was built by older code (rows version 1; " in resumed.stderr
    assert resumed.stderr.strip().splitlines()[-1] == (
        f"error: cannot resume: the number of samples of --data_path differs from the checkpoint's run (checkpoint "
        f"{data} with {before} samples, now {now}), so its position in the epoch would mean other samples; the same "
        "bytes give other samples where other rows are left out as bad (another --bad_data, or other rules of bad "
        "rows: dataset.cache.key.ROWS_VERSION): resume with --bad_data skip and the minisft version that wrote the "
        f"checkpoint, or start a new run from its weights with --from_weight {tmp_path / 'run' / 'model'} --save_dir "
        "NEW_DIR")
    assert not (tmp_path / "run2" / "checkpoints").exists()


def test_a_resume_whose_rebuilt_cache_lost_and_gained_as_many_rows_is_refused_naming_the_file(tmp_path, monkeypatch):
    """The rules of rows version 1 kept a key twice (as its last value) and refused a null 'conversations';
    this code's the other way round: 31 samples each, other ones, told apart by the caches' samples_digest."""
    data = write_lines(tmp_path / "d.jsonl", [*demo_rows(15), KEY_TWICE, *demo_rows(15), NULL_CONVERSATIONS])
    old = plant_rows_1_cache(data, [*demo_rows(15), KEY_TWICE_READ_AS_LAST_VALUE, *demo_rows(15), REFUSED],
                             tmp_path / "cache")
    train_under_rows_1(monkeypatch, tmp_path, data, "run", "--max_steps", "2").check_returncode()

    resumed = train(tmp_path, data, "run2", "--max_steps", "4", "--resume_from", checkpoint_at(tmp_path / "run", 2))
    assert resumed.returncode == 2, resumed.stderr
    metas = [json.loads((cache / "meta.json").read_text(encoding="utf-8"))
             for cache in (old, tmp_path / "cache" / data_key(data))]
    assert [meta["num_samples"] for meta in metas] == [31, 31]
    digests = [meta["samples_digest"] for meta in metas]
    assert resumed.stderr.strip().splitlines()[-1] == (
        f"error: cannot resume: the samples' digest of --data_path differs from the checkpoint's run (checkpoint {data} with "
        f"samples sha256 {digests[0][:16]}, now {digests[1][:16]}), so its position in the epoch would mean other "
        "samples; the same bytes give other samples where other rows are left out as bad (another --bad_data, or "
        "other rules of bad rows: dataset.cache.key.ROWS_VERSION): resume with --bad_data skip and the minisft "
        f"version that wrote the checkpoint, or start a new run from its weights with --from_weight "
        f"{tmp_path / 'run' / 'model'} --save_dir NEW_DIR")
    assert not (tmp_path / "run2" / "checkpoints").exists()


def test_a_resume_whose_rebuilt_cache_keeps_its_rows_is_bit_exact(tmp_path, monkeypatch):
    data = write_lines(tmp_path / "d.jsonl", demo_rows(30))
    train(tmp_path / "whole", data, "whole", "--max_steps", "4").check_returncode()
    train_under_rows_1(monkeypatch, tmp_path, data, "run", "--max_steps", "2").check_returncode()
    resumed = train(tmp_path, data, "run", "--max_steps", "4", "--from_resume", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert "d.jsonl: not reusing the token cache " in resumed.stderr  # built again under this code's rules
    assert "training 4 optimizer steps from step 2" in resumed.stdout
    assert_weights_equal(final_weights(str(tmp_path / "run")), final_weights(str(tmp_path / "whole" / "whole")))


SELECTION = ["--eval_interval", "1", "--keep_best", "eval_loss"]


def resume_selection(tmp_path, monkeypatch, held_out: Path, samples: int):
    """A --keep_best run of 2 steps on `held_out` (of `samples` samples then) under rows version 1,
    then its resume to step 3 under this code's rules: (the best.json of the first run, the resumed run)."""
    data = write_lines(tmp_path / "d.jsonl", demo_rows(30))
    selection = [*SELECTION, "--eval_data_path", str(held_out)]
    train_under_rows_1(monkeypatch, tmp_path, data, "run", "--max_steps", "2", *selection).check_returncode()
    old = json.loads((tmp_path / "run" / "best" / "best.json").read_text(encoding="utf-8"))
    assert old["measured_on"] == [held_out_entry(held_out, samples)]
    resumed = train(tmp_path, data, "run", "--max_steps", "3", "--from_resume", "1", *selection)
    assert resumed.returncode == 0, resumed.stderr
    return old, resumed


def test_a_keep_best_resume_whose_held_out_cache_is_rebuilt_with_the_same_rows_keeps_its_best(tmp_path, monkeypatch):
    """The best's value was measured on the same samples: another rows version alone leaves what it was
    measured on (the key of rows version 1, as such a run recorded it, and the number of samples)."""
    old, resumed = resume_selection(tmp_path, monkeypatch, write_lines(tmp_path / "e.jsonl", demo_rows(8)), 8)
    run = tmp_path / "run"
    assert "e.jsonl: not reusing the token cache " in resumed.stderr  # built again under this code's rules
    assert "--keep_best" not in resumed.stdout and not (run / "set_aside").exists()
    [row] = [row for row in eval_rows(run)[0] if row["step"] == 3]
    improved = row["eval_loss"] < old["value"]
    assert (row["new_best"], row["best_step"], row["best_value"]) == (
        (True, 3, row["eval_loss"]) if improved else (False, old["step"], old["value"]))


def test_a_keep_best_resume_whose_held_out_cache_gained_rows_starts_the_selection_afresh(tmp_path, monkeypatch):
    """Rules that accept other held-out rows measure on other samples: the best of the rows the
    checkpoint's run accepted cannot be compared with, though the held-out file's key stays."""
    held_out = write_lines(tmp_path / "e.jsonl", [*demo_rows(4), NULL_CONVERSATIONS, *demo_rows(4)])
    plant_rows_1_cache(held_out, [*demo_rows(4), REFUSED, *demo_rows(4)], tmp_path / "cache")
    old, resumed = resume_selection(tmp_path, monkeypatch, held_out, 8)
    run = tmp_path / "run"
    [folder] = os.listdir(run / "set_aside")
    assert [line for line in resumed.stdout.splitlines() if line.startswith("--keep_best")] == [
        f"--keep_best eval_loss: the checkpoint's best ({old['value']:.4f} at step {old['step']}) was measured on "
        "other held-out data than this run's --eval_data_path: the selection starts afresh; its best/ (of other "
        f"held-out data) moved to {run / 'set_aside' / folder}"]
    assert json.loads((run / "best" / "best.json").read_text(encoding="utf-8"))["measured_on"] == [
        held_out_entry(held_out, 9)]
