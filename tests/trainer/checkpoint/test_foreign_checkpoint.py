"""A checkpoint of another run copied into a run's checkpoints/: `--from_resume 1` refuses it in one line
instead of continuing that run there. docs/reliability.md maps the case to its test."""

import pytest
import torch

from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process


@pytest.mark.slow
def test_a_checkpoint_of_another_run_copied_into_checkpoints_is_refused_not_continued(data, tmp_path):
    """Another run's newer checkpoint in checkpoints/ (same data and seed, another learning rate): not
    continued as that run, which would rotate this run's checkpoints away and replace its model/."""
    own, other = tmp_path / "own", tmp_path / "other"
    run_trainer_in_process(flags(data, own, "--batch_size", "8", "--max_steps", "4", "--save_interval", "2"), check=True)
    run_trainer_in_process(flags(data, other, "--batch_size", "8", "--max_steps", "6", "--save_interval", "6",
                                 "--learning_rate", "1e-3"), check=True)
    copied = own / "checkpoints" / "step_00000006.pt"
    copied.write_bytes(open(checkpoint_at(other, 6), "rb").read())
    before = {path.name: path.read_bytes() for path in [*(own / "checkpoints").iterdir(), *(own / "model").iterdir()]}
    own_id = torch.load(checkpoint_at(own, 4), weights_only=True)["run_id"]
    other_id = torch.load(checkpoint_at(other, 6), weights_only=True)["run_id"]
    refused = run_trainer_in_process(flags(data, own, "--batch_size", "8", "--max_steps", "8", "--save_interval", "2",
                                           "--keep_last", "2", "--from_resume", "1"))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: the newest checkpoint {copied} is of run {other_id}, which no other checkpoint or metrics.jsonl row in "
        f"{own} records (they are of run {own_id}): a checkpoint of another run copied in? --from_resume 1 would "
        f"continue that run here, rotate this run's checkpoints away and replace its model/; move it out of "
        f"{own / 'checkpoints'}, or give --resume_from {copied} to continue it here"]
    assert {path.name: path.read_bytes() for path in [*(own / "checkpoints").iterdir(), *(own / "model").iterdir()]} == before
    copied.unlink()
    resumed = run_trainer_in_process(flags(data, own, "--batch_size", "8", "--max_steps", "6", "--save_interval", "2",
                                           "--from_resume", "1"), check=True)
    assert f"resuming from {checkpoint_at(own, 4)} (step 4" in resumed.stdout
    assert torch.load(checkpoint_at(own, 6), weights_only=True)["run_id"] == own_id
