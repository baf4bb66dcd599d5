"""The model's kernels on the GPU: attention (varlen, bucketed SDPA, GQA), the fused norm, SwiGLU's
gradient, the MoE combine (collected by tests/test_cuda.py)."""

import functools

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="FlashAttention's varlen kernel needs sm80 or newer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_and_bucketed_sdpa_agree_on_packed_rows(dtype):
    from model import packed_attention
    from tests.helpers.tiny_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    ids, positions = ids.cuda(), positions.cuda()
    results, varlen_calls = {}, []
    original = packed_attention.varlen_attn
    assert original is not None, "this torch has no varlen_attn"

    @functools.wraps(original)  # the signature of the installed varlen_attn, whose keywords are read
    def counted_varlen_attn(*args, **kwargs):
        varlen_calls.append((args[0].shape[1], args[1].shape[1]))  # q heads, k heads
        return original(*args, **kwargs)

    for path in ("varlen", "buckets"):
        model = tiny_model().cuda().train()
        # "buckets": no varlen kernel, which forces the bucketed SDPA path
        packed_attention.varlen_attn = counted_varlen_attn if path == "varlen" else None
        try:
            with torch.autocast("cuda", dtype=dtype):
                out = model(ids, position_ids=positions, labels=ids)
            out.loss.backward()
        finally:
            packed_attention.varlen_attn = original
        results[path] = (out.loss.float(), [p.grad.float() for p in model.parameters()])
    assert len(varlen_calls) == model.config.num_hidden_layers  # the varlen kernel ran, once per layer
    # GQA: the k/v heads reach FlashAttention unrepeated (repeated for the oldest signature only)
    assert set(varlen_calls) == {(4, 2 if packed_attention._varlen_takes("window_size") else 4)}
    (varlen_loss, varlen_grads), (bucket_loss, bucket_grads) = results["varlen"], results["buckets"]
    assert torch.allclose(varlen_loss, bucket_loss, rtol=1e-2)
    for a, b in zip(varlen_grads, bucket_grads):
        assert torch.allclose(a, b, atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("packed", [False, True])
def test_gqa_in_float32_never_reaches_the_math_kernel(packed):
    """Where FlashAttention cannot run (float32 here; fp16 on a pre-Ampere GPU), SDPA runs GQA
    only in its math kernel ([B, H, T, T] scores): with it excluded, a training step still runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.helpers.tiny_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    inputs = dict(position_ids=positions.cuda()) if packed else {}
    model = tiny_model().cuda().train()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = model(ids.cuda(), labels=ids.cuda(), **inputs)
        out.loss.backward()
    assert torch.isfinite(out.loss)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="FlashAttention's varlen kernel needs sm80 or newer")
def test_a_packed_layout_built_on_the_cpu_is_moved_for_the_varlen_kernel():
    from model.packed_attention import PackedDocuments
    from tests.helpers.tiny_model import packed_rows, tiny_model

    ids, positions = packed_rows([[1, 2, 3, 9, 17, 5], [40], [33, 2, 1, 1]], row_len=40)
    model = tiny_model().cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        layout = PackedDocuments.from_position_ids(positions)  # on the CPU
        given = model(ids.cuda(), position_ids=positions.cuda(), packed_layout=layout)
        derived = model(ids.cuda(), position_ids=positions.cuda())
    assert torch.equal(given.logits, derived.logits)


def test_the_norm_is_one_fused_kernel_each_way_and_agrees_with_the_cpu_closed_form():
    """model/rms_norm.py on a GPU: ATen's fused RMSNorm forward and backward, one op each, in bf16,
    with gradients equal to the CPU path's closed form within bf16 rounding."""
    from model.rms_norm import rms_norm
    from scripts._dispatch_counts import DispatchCounter

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 768, generator=generator)
    weight, grad = 1 + 0.1 * torch.randn(768, generator=generator), torch.randn(4, 64, 768, generator=generator)
    results = {}
    for device in ("cuda", "cpu"):
        leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in (x, weight)]
        out_grad = grad.to(device, torch.bfloat16)
        with DispatchCounter() as counter:
            out = rms_norm(*leaves, 1e-6)
            out.backward(out_grad)
        results[device] = [t.float().cpu() for t in (out, leaves[0].grad, leaves[1].grad)]
        if device == "cuda":
            assert out.dtype == torch.bfloat16
            assert {str(op) for op in counter.ops if "rms_norm" in str(op)} == {
                "aten._fused_rms_norm.default", "aten._fused_rms_norm_backward.default"}
            assert counter.total <= 4, dict(counter.ops)
    for gpu, cpu in zip(results["cuda"], results["cpu"]):
        assert torch.allclose(gpu, cpu, rtol=5e-2, atol=5e-2 * cpu.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_writes_the_gradient_autograd_computes_bit_for_bit(dtype):
    """model/feed_forward.py's swiglu writes its gradient's halves through `out=` into one strided
    buffer: on the GPU's kernels too the values are autograd's for silu(gate) * up, for a plain GEMM
    output and for a transposed one (non-contiguous halves)."""
    from model.feed_forward import swiglu

    generator = torch.Generator(device="cuda").manual_seed(0)
    for joined in (torch.randn(64, 96, device="cuda", generator=generator),
                   torch.randn(96, 64, device="cuda", generator=generator).t()):
        joined = joined.to(dtype).requires_grad_()
        reference = joined.detach().clone().requires_grad_()
        grad = torch.randn(64, 48, device="cuda", generator=generator).to(dtype)
        swiglu(joined).backward(grad)
        gate, up = reference.chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up).backward(grad)
        assert torch.equal(joined.grad, reference.grad)


def test_an_moe_layer_of_eight_experts_per_token_gives_the_same_bits_on_every_run():
    """Each token's 8 expert outputs are summed in slot order (model/feed_forward.py), without the
    atomic adds of `index_add_`: two bf16 forward and backward passes agree bit for bit."""
    from model.compute_weights import ComputeWeights, piece_layout
    from tests.helpers.tiny_model import tiny_model

    model = tiny_model(use_moe=True, num_experts=16, num_experts_per_tok=8)
    moe = model.cuda().train().model.layers[0].mlp
    x = torch.randn(4, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = []
    for _ in range(2):
        moe.zero_grad()
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            weights = ComputeWeights(moe, torch.bfloat16, piece_layout(moe, moe.weight_groups()))
            out, balance = moe(x.requires_grad_(), weights)
        (out.float().square().sum() + balance.sum()).backward()
        runs.append([out, x.grad, *(p.grad for p in moe.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
