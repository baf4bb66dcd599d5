"""A --resume_from of a run that --save_dir does not hold is a fork: a line of training of its own (run id,
wandb run), that names where it comes from; a run refused after its claim on --save_dir moved nothing there
(trainer/checkpoint/resume.py:claim_for_resume, trainer/checkpoint/save_dir.py:Claim, trainer/loop/state.py)."""

import json
import os
import shutil

import torch

from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process
from tests.trainer.checkpoint.test_save_dir import write_checkpoint
from trainer.checkpoint.resume import claim_for_resume, load_resume_checkpoint


def files_of(folder) -> dict:
    """Its files' contents, but wandb's logs (a process's wandb runs share one log of its wandb service)."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*")
            if path.is_file() and path.relative_to(folder).parts[0] != "wandb"}


def test_a_resume_of_another_dirs_run_is_a_fork_with_a_run_id_and_a_wandb_run_of_its_own(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    common = ["--batch_size", "8", "--save_interval", "1", "--use_wandb", "1"]
    run_trainer_in_process(flags(data, a_dir, *common, "--max_steps", "2"), check=True)
    a = load_resume_checkpoint(checkpoint_at(a_dir, 1))
    a_files = files_of(a_dir)
    forked = run_trainer_in_process(flags(data, b_dir, *common, "--max_steps", "2", "--resume_from",
                                          checkpoint_at(a_dir, 1)), check=True)
    b = load_resume_checkpoint(checkpoint_at(b_dir, 2))
    origin = {"run_id": a["run_id"], "step": 1, "checkpoint": checkpoint_at(a_dir, 1)}
    assert b["forked_from"] == origin and b["run_id"] != a["run_id"] and b["wandb_run_id"] != a["wandb_run_id"]
    assert (f"fork: {checkpoint_at(a_dir, 1)} is of run {a['run_id']}, which {b_dir} does not hold: this run goes on "
            f"from its step 1 as run {b['run_id']}, with a run id and a wandb run of its own\n") in forked.stdout
    [wandb_run] = [name for name in os.listdir(b_dir / "wandb") if name.startswith("offline-run-")]
    assert wandb_run.endswith("-" + b["wandb_run_id"])  # a new wandb run, not a["wandb_run_id"] resumed
    rows = [json.loads(line) for line in open(b_dir / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["run_id"], row.get("forked_from")) for row in rows] == [(2, b["run_id"], origin)]
    assert files_of(a_dir) == a_files

    # Resumed in its own directory, the fork goes on as itself; it keeps the record of its origin.
    again = run_trainer_in_process(flags(data, b_dir, *common, "--max_steps", "3", "--from_resume", "1"), check=True)
    later = load_resume_checkpoint(checkpoint_at(b_dir, 3))
    assert (later["run_id"], later["wandb_run_id"], later["forked_from"]) == (b["run_id"], b["wandb_run_id"], origin)
    rows = [json.loads(line) for line in open(b_dir / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["run_id"], "forked_from" in row) for row in rows] == [
        (2, b["run_id"], True), (3, b["run_id"], False)]
    assert "fork:" not in again.stdout

    # The fork's checkpoint into the forked run's directory is no resume of that directory's run.
    back = run_trainer_in_process(flags(data, a_dir, *common, "--max_steps", "4", "--resume_from",
                                        checkpoint_at(b_dir, 3)))
    assert (back.returncode, back.stderr.splitlines()) == (2, [
        f"error: --save_dir {a_dir} holds another run (checkpoints/ or model/), not the run {b['run_id']} of the "
        f"--resume_from checkpoint: continue it with --from_resume 1 instead of --resume_from, choose another "
        f"--save_dir, or pass --overwrite 1 to resume there (its files are moved to {a_dir / 'set_aside'}/)"])


def test_overwrite_moves_nothing_when_the_run_is_refused_after_its_claim(data, tmp_path):
    """--overwrite 1 sets the previous run aside only once the resume checkpoint fits the run's sample stream
    and model, the data has been read, and something is left to train: a refusal after the claim leaves the
    directory as it was."""
    run_trainer_in_process(flags(data, tmp_path / "a", "--batch_size", "8", "--max_steps", "1"), check=True)
    b_dir = tmp_path / "b"
    write_checkpoint(b_dir, 5, "b-run")
    (b_dir / "model").mkdir()
    (b_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 5, "run_id": "b-run"}\n')
    before = files_of(b_dir)
    resumed = run_trainer_in_process(flags(data, b_dir, "--batch_size", "8", "--max_steps", "2", "--overwrite", "1",
                                           "--seed", "9", "--resume_from", checkpoint_at(tmp_path / "a", 1)))
    assert (resumed.returncode, resumed.stderr.splitlines()) == (2, [
        "error: cannot resume: --seed differs from the checkpoint's run (checkpoint 42, now 9), so its position in "
        f"the epoch would mean other samples; resume with --seed 42, or start a new run from its weights with "
        f"--from_weight {tmp_path / 'a' / 'model'} --save_dir NEW_DIR"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(data / "train.jsonl", encoding="utf-8").readline() + "{not json\n")
    fresh = run_trainer_in_process([*flags(data, b_dir, "--max_steps", "1", "--overwrite", "1"), "--data_path", str(bad)])
    assert fresh.returncode == 2 and fresh.stderr.splitlines()[-1].startswith(f"error: {bad}:2: invalid JSON")
    finished = run_trainer_in_process(flags(data, b_dir, "--batch_size", "8", "--max_steps", "1", "--overwrite", "1",
                                            "--resume_from", checkpoint_at(tmp_path / "a", 1)))
    assert (finished.returncode, finished.stderr.splitlines()) == (2, [
        "error: nothing left to train: the checkpoint is at step 1 and the run ends at step 1 (--epochs 1, --max_steps "
        f"1); raise --epochs or --max_steps to train further; nothing in {b_dir} was moved"])
    assert files_of(b_dir) == {**before, ".lock": (b_dir / ".lock").read_bytes()}
    assert "moved the previous run's" not in resumed.stdout + fresh.stdout + finished.stdout


def test_the_run_of_a_save_dir_is_read_from_as_few_of_its_checkpoints_as_tell_it(tmp_path, monkeypatch):
    """Where no metrics.jsonl row names the checkpoint's run, the directory's checkpoints tell, newest first, up
    to the first that names it; a checkpoint of the directory's own checkpoints/ is its own without a read."""
    save_dir = tmp_path / "run"
    for step, run_id in ((1, "old-line"), (2, "old-line"), (3, "new-line")):
        write_checkpoint(save_dir, step, run_id)
    read = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: read.append(os.path.basename(path)) or real_load(path, *a, **k))
    elsewhere = str(tmp_path / "copy.pt")
    for run_id, files in (("new-line", ["step_00000003.pt"]), ("old-line", ["step_00000003.pt", "step_00000002.pt"])):
        read.clear()
        claim = claim_for_resume(str(save_dir), elsewhere, {"run_id": run_id, "step": 3}, overwrite=False)
        assert (read, claim.previous, claim.forked_from) == (files, [], None)
    read.clear()
    assert claim_for_resume(str(save_dir), checkpoint_at(save_dir, 1), {"run_id": "old-line", "step": 1},
                            overwrite=False).forked_from is None
    assert read == []


def test_a_fork_of_a_checkpoint_without_a_run_id_says_so(data, tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    run_trainer_in_process(flags(data, a_dir, "--batch_size", "8", "--save_interval", "1", "--max_steps", "1"),
                           check=True)
    saved = load_resume_checkpoint(checkpoint_at(a_dir, 1))
    del saved["run_id"]  # as a checkpoint of a minisft that recorded none
    old = tmp_path / "old" / "step_00000001.pt"
    old.parent.mkdir()
    torch.save(saved, old)
    forked = run_trainer_in_process(flags(data, b_dir, "--batch_size", "8", "--max_steps", "2", "--resume_from",
                                          str(old)), check=True)
    b = load_resume_checkpoint(checkpoint_at(b_dir, 2))
    assert (f"fork: {old} is of run (no run id recorded), which {b_dir} does not hold: this run goes on from its "
            f"step 1 as run {b['run_id']}, with a run id of its own\n") in forked.stdout
    assert b["forked_from"] == {"run_id": None, "step": 1, "checkpoint": str(old)}


def test_only_the_save_dirs_checkpoints_and_set_aside_hold_its_runs_not_a_run_dir_inside_it(tmp_path):
    """A checkpoint of a run directory inside --save_dir is forked like any other run's; one of its set_aside/
    (a run that --overwrite 1 replaced there) goes on as its run, into a directory that holds no other run."""
    save_dir = tmp_path / "p"
    write_checkpoint(save_dir / "old", 2, "a-run")
    inside = checkpoint_at(save_dir / "old", 2)
    claim = claim_for_resume(str(save_dir), inside, {"run_id": "a-run", "step": 2}, overwrite=False)
    assert (claim.previous, claim.forked_from) == ([], {"run_id": "a-run", "step": 2, "checkpoint": inside})
    aside = save_dir / "set_aside" / "20260101-000000-overwritten"
    write_checkpoint(aside, 2, "a-run")
    claim = claim_for_resume(str(save_dir), checkpoint_at(aside, 2), {"run_id": "a-run", "step": 2}, overwrite=False)
    assert (claim.previous, claim.forked_from) == ([], None)


def test_the_same_fork_once_more_is_that_fork_again_in_the_directory_of_its_earlier_try(data, tmp_path):
    """A fork that stopped before its first save left its metrics.jsonl rows, which record where it comes from:
    the same --resume_from again forks anew there, not into another run's directory; where the earlier try
    saved, the new try rolls it back to its start (its checkpoints moved aside, named)."""
    a_dir, c_dir = tmp_path / "a", tmp_path / "c"
    run_trainer_in_process(flags(data, a_dir, "--batch_size", "8", "--max_steps", "1"), check=True)
    fork = flags(data, c_dir, "--batch_size", "8", "--max_steps", "2", "--resume_from", checkpoint_at(a_dir, 1))
    run_trainer_in_process(fork, check=True)
    os.remove(checkpoint_at(c_dir, 2))  # as if killed in its first save
    shutil.rmtree(c_dir / "model")
    again = run_trainer_in_process(fork, check=True)
    origin = {"run_id": load_resume_checkpoint(checkpoint_at(a_dir, 1))["run_id"], "step": 1,
              "checkpoint": checkpoint_at(a_dir, 1)}
    rows = [json.loads(line) for line in open(c_dir / "metrics.jsonl", encoding="utf-8")]
    assert [(row["step"], row["forked_from"]) for row in rows] == [(2, origin), (2, origin)]
    assert rows[1]["run_id"] == load_resume_checkpoint(checkpoint_at(c_dir, 2))["run_id"] != rows[0]["run_id"]
    assert (f"fork: {checkpoint_at(a_dir, 1)} is of run {origin['run_id']}, which {c_dir} does not hold: this run "
            f"goes on from its step 1 as run {rows[1]['run_id']}, with a run id of its own") in again.stdout.splitlines()
    third = run_trainer_in_process(fork, check=True)
    [folder] = os.listdir(c_dir / "set_aside")
    assert (f"resuming at step 1 while later checkpoints exist: moved step_00000002.pt to {c_dir / 'set_aside' / folder} "
            "(the new line of training replaces them; delete that folder once you do not need it)"
            ) in third.stdout.splitlines()
    assert load_resume_checkpoint(checkpoint_at(c_dir, 2))["forked_from"] == origin
