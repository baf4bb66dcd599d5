"""A resume checkpoint whose model tensors are not the run's model's (some left out, some added): one line
counting and naming them, from the check every weights loader shares (trainer/weights/read.py:misfit)."""

import pytest
import torch

from model import MiniMindForCausalLM
from tests.helpers.trainer_launch import checkpoint_at, flags, run_trainer_in_process
from trainer.errors import CheckpointError
from trainer.weights.read import build_config, load_into, read_weights


def test_a_checkpoint_without_a_layer_or_with_an_extra_tensor_is_one_line_naming_them(data, tmp_path):
    run_trainer_in_process(flags(data, tmp_path / "run", "--batch_size", "8", "--max_steps", "1"), check=True)
    saved = torch.load(checkpoint_at(tmp_path / "run", 1), weights_only=True)
    left_out = [key for key in saved["model"] if key.startswith("model.layers.1.")]
    for key in left_out:
        del saved["model"][key]
    saved["model"]["model.extra.weight"] = torch.zeros(2)
    damaged = tmp_path / "damaged.pt"
    torch.save(saved, damaged)
    problems = (f"missing {len(left_out)} tensors ({', '.join(left_out[:3])}, ...); unexpected 1 tensor "
                "(model.extra.weight)")
    assert len(left_out) > 3
    refused = run_trainer_in_process(flags(data, tmp_path / "resumed", "--batch_size", "8", "--max_steps", "2",
                                           "--resume_from", str(damaged)))
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == f"error: resume checkpoint does not fit this run: {problems}"
    weights = read_weights(str(damaged))  # --from_weight, chat, eval and export: the same parts
    with pytest.raises(CheckpointError) as caught:
        load_into(MiniMindForCausalLM(build_config(weights)), weights)
    assert str(caught.value) == f"resume checkpoint {damaged} does not fit its model config: {problems}"
