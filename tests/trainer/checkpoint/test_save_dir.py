"""trainer/checkpoint/save_dir.py: the folders a run writes are checked before anything in --save_dir moves, and
another run's files there are never deleted or replaced: a resume of another run's checkpoint claims the directory."""

import json
import os

import pytest
import torch

from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process
from trainer.checkpoint.resume import claim_for_resume, load_resume_checkpoint
from trainer.checkpoint.save_dir import claim_for_fresh_run
from trainer.checkpoint.single_file import FORMAT
from trainer.errors import CheckpointError


def test_a_cache_dir_that_cannot_be_written_fails_before_the_previous_run_is_set_aside(data, tmp_path):
    # --overwrite 1 sets the previous run aside before the data is read: a --cache_dir that cannot be a folder is
    # found before that, and named by its flag.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002.pt").write_bytes(b"a previous run's checkpoint")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 2}\n')
    (tmp_path / "a_file").write_text("not a directory")
    done = run_trainer_in_process(flags(data, run, "--overwrite", "1", "--cache_dir", str(tmp_path / "a_file")))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: --cache_dir {tmp_path / 'a_file'} cannot be a folder: "
                                        f"{tmp_path / 'a_file'} is a file"]
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert (run / "checkpoints" / "step_00000002.pt").read_bytes() == b"a previous run's checkpoint"


def test_a_save_dir_whose_model_folder_holds_python_source_is_refused_even_with_overwrite(data, tmp_path):
    """`--save_dir . --overwrite 1` in the repository would move the `model/` package aside and
    write weights in its place: every later command would fail to import the model."""
    repo = tmp_path / "checkout"
    (repo / "model").mkdir(parents=True)
    (repo / "model" / "loss.py").write_text("IGNORE_INDEX = -100\n")
    done = run_trainer_in_process(flags(data, repo, "--overwrite", "1"))
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"error: --save_dir {repo}: its model/ holds Python source (minisft's own package?), not a run's weights, "
        "and is never moved: choose another --save_dir"])
    assert sorted(str(path.relative_to(repo)) for path in repo.rglob("*")) == [".lock", "model", "model/loss.py"]


def write_checkpoint(save_dir, step: int, run_id: str | None) -> None:
    """A resume checkpoint of the single-file format holding `run_id` (none when None)."""
    state = {"format": FORMAT, "format_version": 1, "step": step, **({"run_id": run_id} if run_id else {})}
    (save_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.save(state, checkpoint_at(str(save_dir), step))


def test_a_resume_is_into_its_own_dir_where_a_checkpoint_or_a_metrics_row_names_its_run(tmp_path):
    """Its run id in a checkpoint, or only in metrics.jsonl (a rollback's new line rotated the old line's
    checkpoints away), is its own directory; a directory of other run ids is another run's."""
    write_checkpoint(tmp_path, 5, "new-line")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 4, "run_id": "old-line"}\n{"kind": "tr')
    elsewhere = str(tmp_path.parent / "elsewhere.pt")
    for run_id in ("new-line", "old-line"):
        claim_for_resume(str(tmp_path), elsewhere, {"run_id": run_id, "step": 1}, overwrite=False)
    for saved, run in (({"run_id": "other", "step": 1}, "other"), ({"step": 1}, "(no run id recorded)")):
        with pytest.raises(CheckpointError) as refused:
            claim_for_resume(str(tmp_path), elsewhere, saved, overwrite=False)
        assert str(refused.value) == (
            f"--save_dir {tmp_path} holds another run (checkpoints/ or model/), not the run {run} of the --resume_from "
            f"checkpoint: continue it with --from_resume 1 instead of --resume_from, choose another --save_dir, or "
            f"pass --overwrite 1 to resume there (its files are moved to {tmp_path / 'set_aside'}/)")
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "metrics.jsonl"]


@pytest.mark.slow
def test_a_resume_of_another_runs_checkpoint_never_deletes_the_save_dirs_own_run(data, tmp_path):
    common = ["--save_interval", "1", "--keep_last", "2", "--max_steps", "2"]
    run_trainer_in_process(flags(data, tmp_path / "A", *common), check=True)
    run_trainer_in_process(flags(data, tmp_path / "B", *common, "--seed", "7"), check=True)
    before = {path: path.read_bytes() for path in (tmp_path / "B").rglob("*") if path.is_file()}
    [b_run] = {load_resume_checkpoint(checkpoint_at(tmp_path / "B", step))["run_id"] for step in (1, 2)}
    a_run = load_resume_checkpoint(checkpoint_at(tmp_path / "A", 1))["run_id"]
    resume = flags(data, tmp_path / "B", "--save_interval", "1", "--keep_last", "2", "--max_steps", "3",
                   "--resume_from", checkpoint_at(tmp_path / "A", 1))
    refused = run_trainer_in_process(resume)
    assert (refused.returncode, refused.stderr.splitlines()) == (2, [
        f"error: --save_dir {tmp_path / 'B'} holds another run (checkpoints/ or model/), not the run {a_run} of the "
        f"--resume_from checkpoint: continue it with --from_resume 1 instead of --resume_from, choose another "
        f"--save_dir, or pass --overwrite 1 to resume there (its files are moved to {tmp_path / 'B' / 'set_aside'}/)"])
    assert {path: path.read_bytes() for path in (tmp_path / "B").rglob("*") if path.is_file()} == before
    done = run_trainer_in_process([*resume, "--overwrite", "1"], check=True)
    [folder] = os.listdir(tmp_path / "B" / "set_aside")
    aside = tmp_path / "B" / "set_aside" / folder
    assert f"--overwrite 1: moved the previous run's checkpoints, model, metrics.jsonl to {aside}\n" in done.stdout
    assert {aside / path.relative_to(tmp_path / "B"): content for path, content in before.items()
            if path.name != ".lock"} == {path: path.read_bytes() for path in aside.rglob("*") if path.is_file()}
    assert sorted(os.listdir(tmp_path / "B" / "checkpoints")) == ["step_00000002.pt", "step_00000003.pt"]
    rows = [json.loads(line) for line in open(tmp_path / "B" / "metrics.jsonl", encoding="utf-8")]
    fork = load_resume_checkpoint(checkpoint_at(tmp_path / "B", 3))["run_id"]  # a line of training of its own
    assert [(row["step"], row["run_id"]) for row in rows] == [(2, fork), (3, fork)] and fork not in (a_run, b_run)


@pytest.mark.slow
def test_the_minimind_pth_of_save_weight_is_another_runs_file_and_one_of_another_prefix_is_no_runs(data, tmp_path):
    """`--save_weight full_sft` writes SAVE_DIR/full_sft_32.pth: one already there is claimed like checkpoints/
    (refused, or set aside with --overwrite 1); MiniMind's pretrain_32.pth beside it is left as it is."""
    pth = ["--save_weight", "full_sft", "--max_steps", "1", "--save_interval", "1"]
    run_trainer_in_process(flags(data, tmp_path / "run", *pth), check=True)
    weights = (tmp_path / "run" / "full_sft_32.pth").read_bytes()
    minimind = tmp_path / "out"  # MiniMind's out/: downloaded weights, no run
    minimind.mkdir()
    for name in ("full_sft_32.pth", "pretrain_32.pth"):
        (minimind / name).write_bytes(weights)
    refused = run_trainer_in_process(flags(data, minimind, *pth, "--seed", "5"))
    assert (refused.returncode, refused.stderr.splitlines()) == (2, [
        f"error: --save_dir {minimind} holds another run (full_sft_32.pth): choose another --save_dir, or pass "
        f"--overwrite 1 to start over there (its files are moved to {minimind / 'set_aside'}/)"])
    assert sorted(os.listdir(minimind)) == [".lock", "full_sft_32.pth", "pretrain_32.pth"]
    assert (minimind / "full_sft_32.pth").read_bytes() == weights
    again = run_trainer_in_process(flags(data, tmp_path / "run", *pth, "--seed", "5", "--overwrite", "1"), check=True)
    [folder] = os.listdir(tmp_path / "run" / "set_aside")
    aside = tmp_path / "run" / "set_aside" / folder
    assert (f"--overwrite 1: moved the previous run's checkpoints, model, metrics.jsonl, full_sft_32.pth to {aside}\n"
            in again.stdout)
    assert (aside / "full_sft_32.pth").read_bytes() == weights != (tmp_path / "run" / "full_sft_32.pth").read_bytes()
    (minimind / "full_sft_32.pth").unlink()
    run_trainer_in_process(flags(data, minimind, *pth, "--from_weight", "pretrain"), check=True)
    assert sorted(os.listdir(minimind)) == [".lock", "checkpoints", "full_sft_32.pth", "metrics.jsonl", "model",
                                            "pretrain_32.pth"]
    assert (minimind / "pretrain_32.pth").read_bytes() == weights


def test_from_resume_finding_no_checkpoint_refuses_a_pth_that_no_restarted_job_wrote(tmp_path):
    """A .pth is written with a checkpoint: beside none, it is no restarted job's to move aside unasked."""
    (tmp_path / "full_sft_32.pth").write_bytes(b"downloaded weights")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "run_id": "r"}\n')
    with pytest.raises(CheckpointError) as refused:
        claim_for_fresh_run(str(tmp_path), overwrite=False, resuming=True, pth_name="full_sft_32.pth")
    assert str(refused.value) == (
        f"--save_dir {tmp_path} holds another run (metrics.jsonl and full_sft_32.pth): choose another --save_dir, or "
        f"pass --overwrite 1 to start over there (its files are moved to {tmp_path / 'set_aside'}/)")
    assert sorted(os.listdir(tmp_path)) == ["full_sft_32.pth", "metrics.jsonl"]
    not_this_runs = claim_for_fresh_run(str(tmp_path), overwrite=False, resuming=True, pth_name="pretrain_32.pth")
    not_this_runs.carry_out()
    assert sorted(os.listdir(tmp_path)) == ["full_sft_32.pth", "set_aside"]
