"""trainer/data_setup.py: the data files are checked before anything is set aside or tokenized; the start
summary says what the run's --bad_data does with bad rows."""

import re
import shutil
import time

import pytest

from dataset.mixture import parse_data_path
from tests.helpers.trainer_launch import flags, run_trainer_in_process, run_trainer_with_a_read_only
from trainer import data_setup


def test_a_held_out_file_that_cannot_be_read_fails_before_the_training_data_is_tokenized(data, tmp_path):
    # a typo in --eval_data_path is found before the training data's token cache is built and before
    # --overwrite 1 sets the previous run aside
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002.pt").write_bytes(b"a previous run's checkpoint")
    (tmp_path / "empty.jsonl").write_text("\n")
    for held_out, line in ((tmp_path / "evl.jsonl", f"{tmp_path / 'evl.jsonl'}: data file not found"),
                           (tmp_path / "empty.jsonl", f"{tmp_path / 'empty.jsonl'}: data file is empty")):
        done = run_trainer_in_process(flags(data, run, "--overwrite", "1", "--cache_dir", str(tmp_path / "cache"),
                                            "--eval_data_path", str(held_out)))
        assert (done.returncode, done.stderr.splitlines()[-1:]) == (2, [f"error: {line}"])
        assert "tokenizing" not in done.stdout + done.stderr and not (tmp_path / "cache").exists()
        assert not (run / "set_aside").exists() and (run / "checkpoints" / "step_00000002.pt").is_file()


def test_a_held_out_file_that_is_also_training_data_is_said(data, tmp_path):
    done = run_trainer_in_process(flags(data, tmp_path / "run", "--max_steps", "1", "--eval_data_path",
                                        str(data / "train.jsonl")), check=True)
    assert (f"[eval] warning: {data / 'train.jsonl'} is held out and also trained on (--data_path): its evaluation "
            "measures what the model learned of it, not how it does on conversations it has not seen"
            ) in done.stdout.splitlines()
    again = run_trainer_in_process(flags(data, tmp_path / "other", "--max_steps", "1", "--eval_data_path",
                                         str(data / "eval.jsonl")), check=True)
    assert "[eval] warning" not in again.stdout


def test_a_held_out_file_named_twice_is_refused(data, tmp_path):
    # evaluated twice, it would count twice in eval_loss (and in the best-checkpoint choice)
    held_out, link = data / "eval.jsonl", tmp_path / "link.jsonl"
    link.symlink_to(held_out)
    for given, named in ((f"{held_out},{held_out}", f"{held_out} twice"),
                         (f"{held_out},{link}", f"{held_out} twice (as {held_out} and {link})")):
        done = run_trainer_in_process(flags(data, tmp_path / "run", "--eval_data_path", given))
        assert (done.returncode, done.stderr.splitlines()) == (2, [
            f"error: --eval_data_path names {named}: it would be evaluated twice and count twice in eval_loss; give "
            "it once"])
        assert "tokenizing" not in done.stdout and not (tmp_path / "run" / "checkpoints").exists()


def test_the_data_path_is_resolved_once_per_start(data, tmp_path, monkeypatch):
    # the sources checked before anything is set aside are the ones trained on: a glob or folder is
    # listed once, and the checks on its files (read twice, the run's own log) are not done again
    parsed = []

    def counted(spec):
        parsed.append(spec)
        return parse_data_path(spec)

    monkeypatch.setattr(data_setup, "parse_data_path", counted)
    run_trainer_in_process(flags(data, tmp_path / "run", "--max_steps", "1"), check=True)
    assert parsed == [str(data / "train.jsonl")]


def test_a_save_dir_that_a_data_source_reads_is_refused_before_anything_is_written(data, tmp_path):
    """The run writes metrics.jsonl in --save_dir: a directory or glob source there would read it as
    a data shard (on resume: a line without conversations)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(data / "train.jsonl", shards / "part-0.jsonl")
    for spec in (str(shards), str(shards / "*.jsonl")):
        done = run_trainer_in_process([*flags(data, shards)[:-4], "--data_path", spec, "--save_dir", str(shards)])
        assert (done.returncode, done.stderr.splitlines()) == (2, [
            f"error: --save_dir {shards} is where --data_path {spec} reads its files: the run's metrics.jsonl would "
            "be read as data on resume; choose another --save_dir"])
        assert sorted(path.name for path in shards.iterdir()) == [".lock", "part-0.jsonl"]
    done = run_trainer_in_process([*flags(data, shards)[:-4], "--data_path", str(shards / "part-*.jsonl"),
                                   "--save_dir", str(shards), "--max_steps", "1"])
    assert done.returncode == 0, done.stderr  # a glob that cannot match metrics.jsonl


def test_the_bad_rows_warning_says_what_the_run_s_bad_data_does_with_them(data, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text((data / "train.jsonl").read_text(encoding="utf-8") + "{not json\n", encoding="utf-8")
    done = run_trainer_in_process([*flags(data, tmp_path / "run")[:-4], "--data_path", str(train), "--save_dir",
                                   str(tmp_path / "run"), "--max_steps", "1", "--bad_data", "skip"], check=True)
    warnings = [line for line in done.stdout.splitlines() if line.startswith("[data] warning: train: ")]
    assert warnings == [f"[data] warning: train: 1 bad rows, which --bad_data skip leaves out of training (first: {train}:97: "
                        "invalid JSON (Expecting property name enclosed in double quotes at column 2))"]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a read-only bind mount")
def test_data_on_a_read_only_mount_without_cache_dir_names_cache_dir(data, tmp_path):
    # the token cache goes beside the data by default: where it cannot, the line says how to put it elsewhere
    folder = tmp_path / "mounted"
    folder.mkdir()
    shutil.copy(data / "train.jsonl", folder / "train.jsonl")
    result = run_trainer_with_a_read_only(folder, flags(folder, tmp_path / "run", "--max_steps", "1"))
    assert (result.returncode, result.stderr) == (2, f"error: {folder / '.cache'}: Read-only file system; give "
                                                     "--cache_dir DIR for the token cache of train.jsonl\n")
    assert sorted(path.name for path in folder.iterdir()) == ["train.jsonl"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a read-only bind mount")
def test_data_on_a_read_only_mount_under_torchrun_is_one_line_and_no_rank_waits(data, tmp_path):
    # local rank 0 cannot write the cache, nor anything else, in the data's folder: the rank that waits
    # for its build learns the outcome through the store and fails with it at once, as rank 0 does
    folder = tmp_path / "mounted"
    folder.mkdir()
    shutil.copy(data / "train.jsonl", folder / "train.jsonl")
    start = time.monotonic()
    result = run_trainer_with_a_read_only(folder, [*flags(folder, tmp_path / "run", "--max_steps", "1"),
                                                   "--dist_timeout", "600"], nproc=2)
    assert time.monotonic() - start < 120  # two starts of the trainer, no rank waiting for a timeout
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if line.startswith(("error:", "stopped:"))] == [
        f"error: {folder / '.cache'}: Read-only file system; give --cache_dir DIR for the token cache of train.jsonl"]
    assert re.findall(r"exitcode\s*: (\S+) \(pid", output) == ["2", "2"], output[-3000:]  # torchrun's report
    assert sorted(path.name for path in folder.iterdir()) == ["train.jsonl"]


@pytest.mark.parametrize(("flags", "lengths"), [(["--packing", "1"], {64, 100}), ([], {64, 100})])
def test_compiled_batches_round_their_length_up_but_never_past_max_seq_len(data, tmp_path, flags, lengths):
    """--use_compile 1 rounds a batch's length up to a multiple of 64 (fewer shapes, fewer recompiles)
    but not past --max_seq_len: the model's positions may end there (a --from_weight model of fewer)."""
    import torch

    from dataset.rendering import load_tokenizer
    from trainer.args import parse_args
    from trainer.data_setup import build_train_data
    from trainer.runtime.distributed import DistContext

    args = parse_args(["--data_path", str(data / "train.jsonl"), "--cache_dir", str(tmp_path), "--use_compile", "1",
                       "--max_seq_len", "100", "--batch_size", "4", *flags])
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)
    loader = build_train_data(args, load_tokenizer(None), ctx).loader
    assert {batch["input_ids"].shape[1] for batch in loader} == lengths
