"""The best model across a resume: its value is compared only with values of the same metric measured
on the same held-out data (trainer/loop/state.py, trainer/evaluation/selection.py)."""

import json
import os
import shutil

import pytest
import torch

from tests.helpers.cache_checks import held_out_entry
from tests.helpers.trainer_launch import checkpoint_at, eval_rows, flags, run_trainer_in_process
from trainer.evaluation.evaluate import EvalSet
from trainer.evaluation.selection import measured_on, same_measurement

SELECTION = ["--batch_size", "8", "--eval_interval", "1", "--keep_best", "eval_loss"]


def test_a_metric_is_measured_on_the_files_it_covers_and_a_generated_one_on_its_answers_too():
    eval_sets = [EvalSet("b", None, num_replies=3, num_tool_turns=1, data_key="kb", num_samples=9),
                 EvalSet("a", None, num_replies=2, data_key="ka", num_samples=12)]
    assert measured_on(eval_sets, "eval_loss", 64) == ["ka of 12 samples", "kb of 9 samples"]  # no answer generated
    assert measured_on(eval_sets, "eval_token_accuracy/b", 64) == ["kb of 9 samples"]
    assert measured_on(eval_sets, "eval_exact_match", 64) == [
        "ka of 12 samples", "kb of 9 samples", "6 generated answers (prompt rule 2) of at most 64 tokens"]
    assert measured_on(eval_sets, "eval_tool_call_accuracy/b", 8) == [
        "kb of 9 samples", "4 generated answers (prompt rule 2) of at most 8 tokens"]


def test_a_record_of_keys_alone_is_compared_on_its_keys():
    """Runs of rows version 1 recorded each held-out file by its key alone: what both hold is compared."""
    assert same_measurement(["ka", "kb"], ["ka of 12 samples", "kb of 9 samples"])
    assert same_measurement(["ka of 12 samples"], ["ka of 12 samples"])
    assert not same_measurement(["ka of 11 samples"], ["ka of 12 samples"])
    assert not same_measurement(["kc"], ["ka of 12 samples"])
    assert not same_measurement(["ka"], ["ka of 12 samples", "kb of 9 samples"])
    assert not same_measurement(["ka", "2 generated answers (prompt rule 2) of at most 64 tokens"],
                                ["ka of 12 samples", "2 generated answers (prompt rule 2) of at most 8 tokens"])
    # a record that names no prompt rule: answers picked by another rule, other prompts
    assert not same_measurement(["ka of 12 samples", "2 generated answers of at most 64 tokens"],
                                ["ka of 12 samples", "2 generated answers (prompt rule 2) of at most 64 tokens"])


@pytest.fixture(scope="module")
def selected(data, tmp_path_factory):
    """A run of 2 steps keeping its best eval_loss on the demo eval.jsonl, and a held-out file of other rows."""
    folder = tmp_path_factory.mktemp("selected")
    run_trainer_in_process(flags(data, folder / "run", *SELECTION, "--max_steps", "2",
                                 "--eval_data_path", str(data / "eval.jsonl")), check=True)
    (folder / "other.jsonl").write_text("".join(open(data / "eval.jsonl", encoding="utf-8").readlines()[:8]))
    return folder


def resume(data, run, eval_path):
    return run_trainer_in_process(flags(data, run, *SELECTION, "--max_steps", "3", "--from_resume", "1",
                                        "--eval_data_path", str(eval_path)), check=True)


def test_a_resume_on_other_held_out_data_starts_the_selection_afresh(data, selected, tmp_path):
    run, other = tmp_path / "run", selected / "other.jsonl"
    shutil.copytree(selected / "run", run)
    old_best = (run / "best" / "best.json").read_text()
    assert json.loads(old_best)["measured_on"] == [held_out_entry(data / "eval.jsonl", 16)]
    resumed = resume(data, run, other)
    [folder] = os.listdir(run / "set_aside")
    notes = [line for line in resumed.stdout.splitlines() if line.startswith("--keep_best")]
    assert notes == [f"--keep_best eval_loss: the checkpoint's best ({json.loads(old_best)['value']:.4f} at step "
                     f"{json.loads(old_best)['step']}) was measured on other held-out data than this run's "
                     f"--eval_data_path: the selection starts afresh; its best/ (of other held-out data) moved to "
                     f"{run / 'set_aside' / folder}"]
    [row] = [row for row in eval_rows(run)[0] if row["step"] == 3]
    assert (row["new_best"], row["best_step"], row["best_value"]) == (True, 3, row["eval_loss"])
    assert (run / "set_aside" / folder / "best" / "best.json").read_text() == old_best
    assert json.loads((run / "best" / "best.json").read_text())["measured_on"] == [held_out_entry(other, 8)]
    assert torch.load(checkpoint_at(run, 2), weights_only=True)["best_measured_on"] == [
        held_out_entry(data / "eval.jsonl", 16)]
    assert torch.load(checkpoint_at(run, 3), weights_only=True)["best_measured_on"] == [held_out_entry(other, 8)]


@pytest.mark.parametrize("case", ["moved", "unrecorded"])
def test_a_resume_keeps_comparing_with_the_best_on_the_same_or_unrecorded_held_out_data(data, selected, tmp_path, case):
    """A byte-identical copy of the held-out file elsewhere is the same data; a checkpoint (and best.json)
    that records no held-out data is taken as measured on this run's, as before the record existed."""
    run = tmp_path / "run"
    shutil.copytree(selected / "run", run)
    eval_path = tmp_path / "elsewhere" / "eval.jsonl"
    eval_path.parent.mkdir()
    shutil.copyfile(data / "eval.jsonl", eval_path)
    if case == "unrecorded":
        eval_path = selected / "other.jsonl"
        saved = torch.load(checkpoint_at(run, 2), weights_only=True)
        del saved["best_measured_on"]
        torch.save(saved, checkpoint_at(run, 2))
        record = json.loads((run / "best" / "best.json").read_text())
        del record["measured_on"]
        (run / "best" / "best.json").write_text(json.dumps(record))
    old = json.loads((run / "best" / "best.json").read_text())
    resumed = resume(data, run, eval_path)
    assert "--keep_best" not in resumed.stdout and not (run / "set_aside").exists()
    [row] = [row for row in eval_rows(run)[0] if row["step"] == 3]
    improved = row["eval_loss"] < old["value"]
    assert (row["new_best"], row["best_step"], row["best_value"]) == (
        (True, 3, row["eval_loss"]) if improved else (False, old["step"], old["value"]))


def test_a_fork_starts_a_selection_of_its_own_in_its_save_dir(data, selected, tmp_path):
    """The checkpoint's best is in the best/ of the run it forks: the fork's best/ is its own, so its selection
    starts afresh (else an evaluation that does not beat the other directory's best leaves it none)."""
    old = json.loads((selected / "run" / "best" / "best.json").read_text())
    forked_run = torch.load(checkpoint_at(selected / "run", 2), weights_only=True)["run_id"]
    fork = tmp_path / "fork"
    forked = run_trainer_in_process(flags(data, fork, *SELECTION, "--max_steps", "3", "--eval_data_path",
                                          str(data / "eval.jsonl"), "--resume_from", checkpoint_at(selected / "run", 2)),
                                    check=True)
    notes = [line for line in forked.stdout.splitlines() if line.startswith("--keep_best")]
    assert notes == [f"--keep_best eval_loss: the checkpoint's best ({old['value']:.4f} at step {old['step']}) is in "
                     f"the best/ of run {forked_run}, not in this fork's --save_dir: the selection starts afresh"]
    [row] = eval_rows(fork)[0]
    assert (row["step"], row["new_best"], row["best_step"], row["best_value"]) == (3, True, 3, row["eval_loss"])
    assert json.loads((fork / "best" / "best.json").read_text())["step"] == 3


def test_a_fork_without_keep_best_keeps_no_best_of_the_run_it_forks(data, selected, tmp_path):
    """Whatever its flags, a fork's selection starts afresh: a later resume of it with --keep_best keeps its first
    evaluation in the fork's own best/, never comparing with a best that is in the forked run's directory."""
    fork = tmp_path / "fork"
    run_trainer_in_process(flags(data, fork, "--batch_size", "8", "--max_steps", "3", "--resume_from",
                                 checkpoint_at(selected / "run", 2)), check=True)
    saved = torch.load(checkpoint_at(fork, 3), weights_only=True)
    assert [saved[name] for name in ("best_metric", "best_value", "best_step", "best_measured_on",
                                     "evals_without_improvement")] == [None, None, None, None, 0]
    run_trainer_in_process(flags(data, fork, *SELECTION, "--max_steps", "4", "--from_resume", "1",
                                 "--eval_data_path", str(data / "eval.jsonl")), check=True)
    [row] = eval_rows(fork)[0]
    assert (row["step"], row["new_best"], row["best_step"], row["best_value"]) == (4, True, 4, row["eval_loss"])
    assert json.loads((fork / "best" / "best.json").read_text())["step"] == 4


def test_a_resume_with_other_generation_settings_starts_the_selection_of_a_generated_score_afresh(data, tmp_path):
    """Exact match of answers cut at 8 tokens is no measure of answers of 64: another --eval_max_new_tokens
    (or --eval_generate_samples) restarts the selection of eval_exact_match, as other held-out data does."""
    run = tmp_path / "run"
    generated = ["--batch_size", "8", "--eval_interval", "1", "--keep_best", "eval_exact_match",
                 "--eval_generate_samples", "2", "--eval_data_path", str(data / "eval.jsonl")]
    run_trainer_in_process(flags(data, run, *generated, "--max_steps", "2"), check=True)
    old = json.loads((run / "best" / "best.json").read_text())
    assert old["measured_on"] == [held_out_entry(data / "eval.jsonl", 16),
                                  "2 generated answers (prompt rule 2) of at most 64 tokens"]
    resumed = run_trainer_in_process(flags(data, run, *generated, "--max_steps", "3", "--from_resume", "1",
                                           "--eval_max_new_tokens", "8"), check=True)
    [folder] = os.listdir(run / "set_aside")
    notes = [line for line in resumed.stdout.splitlines() if line.startswith("--keep_best")]
    assert notes == [f"--keep_best eval_exact_match: the checkpoint's best ({old['value']:.4f} at step {old['step']}) "
                     "was measured on other held-out data or generated answers than this run's --eval_data_path, "
                     "--eval_generate_samples or --eval_max_new_tokens: the selection starts afresh; its best/ (of "
                     f"other held-out data or generated answers) moved to {run / 'set_aside' / folder}"]
    assert folder.endswith("-best-of-other-held-out-data-or-generated-answers")
    [row] = [row for row in eval_rows(run)[0] if row["step"] == 3]
    assert (row["new_best"], row["best_step"], row["best_value"]) == (True, 3, row["eval_exact_match"])
    assert json.loads((run / "best" / "best.json").read_text())["measured_on"] == [
        held_out_entry(data / "eval.jsonl", 16), "2 generated answers (prompt rule 2) of at most 8 tokens"]


def stopping_early(data, save_dir, save_interval: int) -> list[str]:
    """Flags of a run that stops early at step 2: a learning rate this small leaves the argmax predictions
    unchanged, so the token accuracy never improves after the first evaluation and patience 1 (the last
    flag) stops the run at its second evaluation."""
    return flags(data, save_dir, "--batch_size", "8", "--max_steps", "6", "--eval_interval", "1", "--save_interval",
                 str(save_interval), "--learning_rate", "1e-9", "--eval_data_path", str(data / "eval.jsonl"),
                 "--keep_best", "eval_token_accuracy", "--early_stop_patience", "1")


def test_a_restarted_early_stopped_run_trains_nothing_and_a_larger_patience_trains_on(data, tmp_path):
    run = tmp_path / "run"
    argv = stopping_early(data, run, save_interval=0)
    assert "stopped early" in run_trainer_in_process(argv, check=True).stdout
    assert os.listdir(run / "checkpoints") == ["step_00000002.pt"]
    model = (run / "model" / "model.safetensors").read_bytes()
    again = run_trainer_in_process([*argv, "--from_resume", "1"], check=True)  # the same command, restarted
    assert ("nothing left to train: eval_token_accuracy has not improved in the checkpoint's last 1 evaluations "
            "(best ") in again.stdout
    assert ("at step 1), where --early_stop_patience 1 stops the run; raise --early_stop_patience, or give 0, "
            "to train further") in again.stdout
    assert "step 3/" not in again.stdout and "eval step" not in again.stdout
    assert os.listdir(run / "checkpoints") == ["step_00000002.pt"]
    assert (run / "model" / "model.safetensors").read_bytes() == model
    on = run_trainer_in_process([*argv[:-1], "3", "--from_resume", "1"], check=True)
    assert "step 3/6" in on.stdout and "nothing left" not in on.stdout
    assert [row["step"] for row in eval_rows(run)[0]] == [1, 2, 3, 4]  # patience 3: two more evaluations, then stop


def test_a_resume_from_an_early_stopped_checkpoint_is_refused_before_anything_moves(data, tmp_path):
    # as a resume past the last step is: with --resume_from (a rollback, a fork) it would set checkpoints
    # aside or start a fork, then train nothing
    run = tmp_path / "run"
    assert "stopped early" in run_trainer_in_process(stopping_early(data, run, save_interval=1), check=True).stdout
    assert os.listdir(run / "checkpoints") == ["step_00000001.pt", "step_00000002.pt"]
    for save_dir in (run, tmp_path / "fork"):  # a resume in place, a fork
        done = run_trainer_in_process([*stopping_early(data, save_dir, save_interval=1), "--resume_from",
                                       checkpoint_at(run, 2)])
        assert (done.returncode, done.stderr.splitlines()[-1:]) == (2, [
            "error: nothing left to train: eval_token_accuracy has not improved in the checkpoint's last 1 evaluations "
            f"(best {json.loads((run / 'best' / 'best.json').read_text())['value']:.4f} at step 1), where "
            "--early_stop_patience 1 stops the run; raise --early_stop_patience, or give 0, to train further; nothing "
            f"in {save_dir} was moved"])
    assert sorted(os.listdir(run)) == [".lock", "best", "checkpoints", "metrics.jsonl", "model"]
    assert os.listdir(tmp_path / "fork") == [".lock"]  # the save dir's lock, taken first
    assert os.listdir(run / "checkpoints") == ["step_00000001.pt", "step_00000002.pt"]
