"""A new line of training in a directory that records the line it comes from: a rollback, or a fork
tried again there, stopped after its first checkpoint and before its first metrics.jsonl row, is
continued by --from_resume 1 (trainer/checkpoint/resume.py: check_of_the_dirs_runs); a rollback
stopped before its first checkpoint is a new line again when tried again (left_by_a_rollback)."""

import json
import os

import pytest

from scripts.plot_loss import latest_run
from tests.helpers.faults import run_in_this_process
from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process
from trainer.checkpoint.resume import load_resume_checkpoint


def test_a_rollback_that_stops_after_its_first_checkpoint_is_continued_by_from_resume(data, tmp_path):
    # The new line's first checkpoint (step 3) is the only record of its run id: the run stops at step 4,
    # before its first metrics.jsonl row (--log_interval 100), beside the old line's rows and step 2.
    common = ["--batch_size", "8", "--log_interval", "100", "--save_interval", "1"]
    run_trainer_in_process(flags(data, tmp_path, *common, "--max_steps", "4", "--save_interval", "2", "--log_interval", "1"),
                           check=True)
    old_line = load_resume_checkpoint(checkpoint_at(tmp_path, 2))["run_id"]
    stopped = run_in_this_process(flags(data, tmp_path, *common, "--max_steps", "8", "--resume_from",
                                        checkpoint_at(tmp_path, 2)), MINISFT_FAULT_CPU_OOM_STEP="4")
    assert stopped.returncode == 1 and "error: step 4 ran out of memory" in stopped.stderr, stopped.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002.pt", "step_00000003.pt"]
    new = load_resume_checkpoint(checkpoint_at(tmp_path, 3))
    assert new["run_id"] != old_line and new["rolled_back_from"] == {"run_id": old_line, "step": 2}
    again = run_trainer_in_process(flags(data, tmp_path, *common, "--max_steps", "5", "--from_resume", "1"), check=True)
    assert f"resuming from {checkpoint_at(tmp_path, 3)} (step 3" in again.stdout
    assert load_resume_checkpoint(checkpoint_at(tmp_path, 5))["run_id"] == new["run_id"]  # the same line goes on
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["run_id"] == new["run_id"], row.get("rolled_back_from")) for row in rows] == [
        (1, False, None), (2, False, None), (3, False, None), (4, False, None),
        (5, True, {"run_id": old_line, "step": 2})]  # the first row of each process of the new line says it
    assert [row["step"] for row in latest_run(rows)[0]] == [1, 2, 5]  # what plot_loss.py draws


def test_a_fork_tried_again_that_stops_after_its_first_checkpoint_is_continued_by_from_resume(data, tmp_path):
    # The first try logs a row (it records the fork) and saves past the start; the second try, a fork
    # again, sets that checkpoint aside and stops after its own first checkpoint, before any row.
    origin, fork_dir = tmp_path / "origin", tmp_path / "fork"
    run_trainer_in_process(flags(data, origin, "--batch_size", "8", "--max_steps", "2"), check=True)
    again = ["--batch_size", "8", "--save_interval", "1", "--max_steps", "8", "--resume_from", checkpoint_at(origin, 2)]
    first = run_in_this_process(flags(data, fork_dir, *again), MINISFT_FAULT_CPU_OOM_STEP="4")
    assert first.returncode == 1 and os.path.exists(checkpoint_at(fork_dir, 3)), first.stderr
    second = run_in_this_process(flags(data, fork_dir, *again, "--log_interval", "100"), MINISFT_FAULT_CPU_OOM_STEP="4")
    assert second.returncode == 1 and "error: step 4 ran out of memory" in second.stderr, second.stderr
    assert sorted(os.listdir(fork_dir / "checkpoints")) == ["step_00000003.pt"]
    line = load_resume_checkpoint(checkpoint_at(fork_dir, 3))
    assert line["rolled_back_from"] is None and line["forked_from"]["checkpoint"] == checkpoint_at(origin, 2)
    resumed = run_trainer_in_process(flags(data, fork_dir, "--batch_size", "8", "--max_steps", "4", "--from_resume", "1"),
                                     check=True)
    assert f"resuming from {checkpoint_at(fork_dir, 3)} (step 3" in resumed.stdout
    assert load_resume_checkpoint(checkpoint_at(fork_dir, 4))["run_id"] == line["run_id"]


@pytest.mark.parametrize("again", ["resume_from", "from_resume"])
def test_a_rollback_that_stops_before_its_first_checkpoint_is_a_new_line_when_tried_again(data, tmp_path, again):
    # The first try sets step 4 aside and stops at step 3, leaving no record of its run id; step 2
    # is then the directory's newest checkpoint, of the old line, whose later steps set_aside/ holds.
    common = ["--batch_size", "8", "--save_interval", "2", "--max_steps", "4"]
    run_trainer_in_process(flags(data, tmp_path, *common), check=True)
    old_line = load_resume_checkpoint(checkpoint_at(tmp_path, 2))["run_id"]
    rollback = flags(data, tmp_path, *common, "--resume_from", checkpoint_at(tmp_path, 2))
    stopped = run_in_this_process(rollback, MINISFT_FAULT_CPU_OOM_STEP="3")
    assert stopped.returncode == 1 and "error: step 3 ran out of memory" in stopped.stderr, stopped.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002.pt"]
    command = rollback if again == "resume_from" else flags(data, tmp_path, *common, "--from_resume", "1")
    retried = run_trainer_in_process(command, check=True)
    folder = next((tmp_path / "set_aside").iterdir())
    assert (f"resuming at step 2, where a rollback left run {old_line}'s later checkpoints ({folder}): "
            "this run is a new line of training, as that rollback was") in retried.stdout
    new = load_resume_checkpoint(checkpoint_at(tmp_path, 4))
    assert new["run_id"] != old_line and new["rolled_back_from"] == {"run_id": old_line, "step": 2}
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["run_id"] == new["run_id"], row.get("rolled_back_from")) for row in rows] == [
        (1, False, None), (2, False, None), (3, False, None), (4, False, None),
        (3, True, {"run_id": old_line, "step": 2}), (4, True, None)]
    assert [(row["step"], row["run_id"] == new["run_id"]) for row in latest_run(rows)[0]] == [
        (1, False), (2, False), (3, True), (4, True)]  # what plot_loss.py draws: the old line up to step 2
