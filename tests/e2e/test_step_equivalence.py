"""One optimizer step is the same mathematics however its rows are split: 2 ranks x B rows x
accumulation 2 (DDP's `no_sync()` micro-steps) equals 1 rank x 4B rows, dense and MoE (the MoE
balance loss is per row and divided by the step's global row count), and so does a MoE model under
--fsdp 1 (every expert sharded, a reduce-scatter per micro-batch)."""

import os

import pytest

from tests.helpers.trainer_launch import (
    SCRIPT, assert_weights_equal, final_weights, flags, run_ranks_apart, run_trainer_in_process, together, train_losses,
)

pytestmark = pytest.mark.slow

# A strong balance loss and 2 experts per token, so a wrong normaliser would show in the weights.
MOE = ["--use_moe", "1", "--num_experts", "4", "--num_experts_per_tok", "2", "--aux_loss_coef", "0.1"]


@pytest.mark.parametrize("model_flags,split_flags", [([], []), (MOE, []), (MOE, ["--fsdp", "1"])],
                         ids=["dense", "moe", "moe-fsdp"])
def test_two_ranks_with_accumulation_equal_one_rank_with_the_whole_batch(data, tmp_path, model_flags, split_flags):
    steps = ["--max_steps", "3", "--save_interval", "0", "--learning_rate", "1e-3", "--warmup_steps", "10",
             *model_flags]
    # the two ranks as two plain processes (RANK, WORLD_SIZE in their environment): the launcher is not what is checked
    _, ranks = together(
        lambda: run_trainer_in_process(flags(data, tmp_path / "one", "--batch_size", "8", *steps), check=True),
        lambda: run_ranks_apart(SCRIPT, flags(data, tmp_path / "split", "--batch_size", "2", "--accumulation_steps", "2",
                                              *steps, *split_flags), local_ranks=(0, 1)))
    assert [rank.returncode for rank in ranks] == [0, 0], ranks
    sharded = ["step_00000003.dcp"] if split_flags else ["step_00000003.pt"]
    assert sorted(os.listdir(tmp_path / "split" / "checkpoints")) == sharded
    one, split = final_weights(tmp_path / "one"), final_weights(tmp_path / "split")
    assert_weights_equal(split, one, atol=1e-5)
    losses = train_losses(tmp_path / "one")
    assert sorted(losses) == [1, 2, 3]
    split_losses = train_losses(tmp_path / "split")
    assert sorted(split_losses) == [1, 2, 3]
    for step, loss in split_losses.items():
        assert loss == pytest.approx(losses[step], abs=1e-5)
