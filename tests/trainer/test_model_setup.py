"""trainer/model_setup.py in a run: which weights a run starts from (--from_weight against a
resume checkpoint) and which tokenizer goes with them."""

import os

from tests.helpers.trainer_launch import flags, run_trainer


def test_a_resume_checkpoint_wins_over_from_weight_and_the_log_says_so(data, tmp_path):
    run = tmp_path / "run"
    run_trainer(flags(data, run, "--batch_size", "8", "--max_steps", "2", "--save_interval", "1"))
    other = tmp_path / "other"  # weights of the same architecture, saved elsewhere
    run_trainer(flags(data, other, "--batch_size", "8", "--max_steps", "1", "--seed", "7"))
    resumed = run_trainer(flags(data, run, "--batch_size", "8", "--max_steps", "3", "--from_resume", "1",
                                "--from_weight", str(other / "model")))
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("weights: ")]
    assert lines == [f"weights: those of the resume checkpoint (step 2); --from_weight {other / 'model'} is ignored: "
                     "the resume checkpoint's weights win"]
    # --from_resume 1 with no checkpoint yet: a fresh run from those weights, and the line says that instead
    fresh = run_trainer(flags(data, tmp_path / "fresh", "--batch_size", "8", "--max_steps", "1", "--from_resume", "1",
                              "--from_weight", str(other / "model")))
    assert [line for line in fresh.stdout.splitlines() if line.startswith("weights: ")] == [
        f"weights: qwen3 model {other / 'model'}"]
    assert os.path.isdir(tmp_path / "fresh" / "model")
