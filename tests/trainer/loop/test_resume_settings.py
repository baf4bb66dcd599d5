"""What a resume takes from its flags and what from its checkpoint: the optimizer's settings."""

import shutil

import torch

from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process


def test_a_resume_trains_with_its_own_weight_decay(data, tmp_path):
    """--weight_decay on a resume acts from the first resumed step, as --learning_rate does; the
    checkpoint's optimizer groups (the run that wrote it) do not keep theirs."""
    first = tmp_path / "first"
    run_trainer_in_process(flags(data, first, "--batch_size", "8", "--max_steps", "2", "--weight_decay", "0.01"),
                           check=True)
    same = tmp_path / "same"
    shutil.copytree(first, same)
    for folder, decay in ((first, "0.5"), (same, "0.01")):
        run_trainer_in_process(flags(data, folder, "--batch_size", "8", "--max_steps", "3", "--weight_decay", decay,
                                     "--from_resume", "1"), check=True)
    start = torch.load(checkpoint_at(first, 2), weights_only=True)["model"]
    changed, kept = (torch.load(checkpoint_at(folder, 3), weights_only=True) for folder in (first, same))
    assert [group["weight_decay"] for group in changed["optimizer"]["param_groups"]] == [0.5, 0.0]
    assert [group["weight_decay"] for group in kept["optimizer"]["param_groups"]] == [0.01, 0.0]
    lr = changed["optimizer"]["param_groups"][0]["lr"]
    assert lr == kept["optimizer"]["param_groups"][0]["lr"] == 3e-3 * 3 / 10  # step 3 of warmup 10
    # AdamW decays a matrix by lr x weight_decay before its update: the two step-3 weights differ by exactly that
    for name, weight in start.items():
        difference = changed["model"][name] - kept["model"][name]
        expected = -lr * (0.5 - 0.01) * weight if weight.dim() >= 2 else torch.zeros_like(weight)
        torch.testing.assert_close(difference, expected, rtol=0, atol=1e-7, msg=name)
