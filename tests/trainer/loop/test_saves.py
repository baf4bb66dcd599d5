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


def test_a_save_out_of_memory_says_what_this_run_holds_on_the_device():
    """One process with --fsdp 1 trains replicated (nothing is gathered): the line names the cast and
    its remedy; several processes under --fsdp 1 gather each weight in full, no cast to advise on."""
    from types import SimpleNamespace

    from tests.trainer.loop.test_loop_syncs import tiny_run
    from trainer.loop.out_of_memory import save_out_of_memory

    run = tiny_run(torch.device("cpu"))
    run.args = SimpleNamespace(**vars(run.args), fsdp=1, save_dtype="bfloat16")
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert save_out_of_memory(run, error, "the save") == (
        "the save at step 0 ran out of memory on cpu (CUDA out of memory. Tried to allocate 2.00 GiB.): a save holds "
        "one weight at a time cast to --save_dtype bfloat16 on the device beside the weights and optimizer state; "
        "--save_dtype float32 casts none; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation. "
        "The files already in out are kept")
    run.parallel = SimpleNamespace(checkpoint_kind="sharded")
    assert "a save holds each weight gathered in full, one at a time on the device beside the weights and optimizer " \
           "state; PYTORCH_CUDA_ALLOC_CONF" in save_out_of_memory(run, error, "the save")
