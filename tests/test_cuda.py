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


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="FlashAttention's varlen kernel needs sm80 or newer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_and_bucketed_sdpa_agree_on_packed_rows(dtype):
    from model import packed_attention
    from tests.test_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    ids, positions = ids.cuda(), positions.cuda()
    results = {}
    for path in ("varlen", "buckets"):
        model = tiny_model().cuda().train()
        original = packed_attention.varlen_attn
        if path == "buckets":
            packed_attention.varlen_attn = None  # forces the bucketed SDPA path
        try:
            with torch.autocast("cuda", dtype=dtype):
                out = model(ids, position_ids=positions, labels=ids)
            out.loss.backward()
        finally:
            packed_attention.varlen_attn = original
        results[path] = (out.loss.float(), [p.grad.float() for p in model.parameters()])
    assert packed_attention.varlen_attn is not None, "this torch has no varlen_attn"
    (varlen_loss, varlen_grads), (bucket_loss, bucket_grads) = results["varlen"], results["buckets"]
    assert torch.allclose(varlen_loss, bucket_loss, rtol=1e-2)
    for a, b in zip(varlen_grads, bucket_grads):
        assert torch.allclose(a, b, atol=2e-2, rtol=5e-2)
