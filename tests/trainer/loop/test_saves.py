"""trainer/loop/saves.py across processes: the ranks learn how rank 0's write ended through the
store, so a write longer than --dist_timeout fails nobody."""

import os

import pytest
import torch

from tests.helpers.trainer_launch import REPO, flags, run_ranks_apart
from trainer.checkpoint.save_dir import checkpoint_path


@pytest.mark.slow
def test_a_final_write_longer_than_dist_timeout_fails_nobody(data, tmp_path):
    # Two gloo processes, --dist_timeout 4; rank 0's write of model/ takes 12 s longer, so rank 1
    # waits three times the collective timeout for the end of the final save.
    timeout, save_dir = 4, tmp_path / "run"
    args = [*flags(data, save_dir, "--batch_size", "2", "--max_steps", "2", "--save_interval", "0"),
            "--dist_timeout", str(timeout)]
    ranks = run_ranks_apart(os.path.join(REPO, "tests", "helpers", "slow_publish.py"), args, local_ranks=(0, 1),
                            MINISFT_TEST_SLOW_PUBLISH_S="12")
    assert [rank.returncode for rank in ranks] == [0, 0], ranks
    waits = [line for line in ranks[1].stderr.splitlines()
             if line.startswith("rank 1: waiting for rank 0 to finish writing the checkpoint (")]
    assert len(waits) >= 2 * timeout, ranks[1]  # one a second, for longer than the collective timeout
    assert torch.load(checkpoint_path(str(save_dir), 2), weights_only=True)["step"] == 2
    assert os.path.isfile(save_dir / "model" / "model.safetensors")
