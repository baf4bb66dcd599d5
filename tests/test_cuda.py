"""The CUDA paths (cuda autocast, the fp16 GradScaler, NCCL): run where a GPU is present,
skipped on CPU-only machines such as CI."""

import pytest
import torch

from tests.trainer_launch import final_weights, flags, run_trainer, train_losses

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_gpu_trains_with_autocast_and_grad_scaler(data, tmp_path, dtype):
    args = flags(data, tmp_path, "--batch_size", "8", "--max_steps", "4", "--dtype", dtype, "--device", "cuda")
    result = run_trainer(args)
    assert "device cuda:0" in result.stdout
    losses = train_losses(tmp_path)
    assert losses[4] < losses[1]
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path).values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_nccl_equal_one_gpu_with_double_batch(data, tmp_path):
    common = ["--max_steps", "3", "--dtype", "float32", "--save_interval", "0"]
    run_trainer(flags(data, tmp_path / "two", "--batch_size", "4", "--backend", "nccl", *common), nproc=2)
    run_trainer(flags(data, tmp_path / "one", "--batch_size", "8", *common))
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-4), key
