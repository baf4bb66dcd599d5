"""Generation on the GPU: padded prompts, the KV cache's GQA read, the GEMMs of a decode step
(collected by tests/test_cuda.py)."""

import contextlib

import pytest
import torch

from tests.cuda.host_syncs import without_host_sync


@contextlib.contextmanager
def ieee_float32():
    """float32 GEMMs in IEEE float32 inside, as the CPU's, whatever an earlier test of the process
    left (trainer/runtime/precision.py `apply_tf32_policy`: TF32 beside a bf16 autocast)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_padded_prompts_generate_the_cpus_tokens_reading_the_cache_unexpanded(monkeypatch):
    """A left-padded batch in float32: the prefill runs the prompts as documents, no dense mask
    (`PackedDocuments.of_padded_rows`); each decode step, whose padding mask keeps CUDA's SDPA from
    GQA (`gqa_needs_expanded_heads`), runs its query heads as the rows of their k/v head, so the
    cache is read with its 2 heads, not repeated to 4. The tokens are the CPU's, the logits within
    float32 rounding (tests/model/test_modeling.py has the CPU's side of each)."""
    from model.packed_attention import PackedDocuments
    from tests.helpers.tiny_model import tiny_model
    from tests.model.test_compute_weights import greedy

    batch = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    batch[0, :3] = 0
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    expected = greedy(tiny_model(), batch, 5, attention_mask=mask)
    calls, layouts = [], []
    sdpa, of_padded_rows = torch.nn.functional.scaled_dot_product_attention, PackedDocuments.of_padded_rows

    def spy(q, k, v, **options):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return sdpa(q, k, v, **options)

    def recorded(cls, positions, attention_mask):
        layouts.append(of_padded_rows(positions, attention_mask))
        return layouts[-1]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(PackedDocuments, "of_padded_rows", classmethod(recorded))
    model = tiny_model().cuda()
    with ieee_float32():
        got = greedy(model, batch.cuda(), 5, attention_mask=mask.cuda())
    assert len(layouts) == 1 and layouts[0] is not None and layouts[0].device.type == "cuda"
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    for ours, cpus in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(ours.cpu(), cpus, rtol=0, atol=1e-4)
    decode = [((2, 2, 2, 16), (2, 2, 7 + step, 16)) for step in range(1, 5) for _ in range(model.config.num_hidden_layers)]
    assert calls[-len(decode):] == decode


@pytest.mark.parametrize("use_moe, dtype, groups", [
    (False, torch.bfloat16, 2),  # q/k/v and gate/up
    (True, torch.bfloat16, 3),  # q/k/v and the experts' two
    (True, torch.float32, 2),  # the experts' two (fp32 q/k/v never join)
])
def test_decode_steps_concatenate_no_weights_and_give_the_joined_gemms_tokens(monkeypatch, use_moe, dtype, groups):
    """A model in its compute dtype (chat.py --device cuda --dtype bfloat16; an fp32 MoE): generation
    runs its groups of weights as separate GEMMs, concatenating none (`JoinedGemm.joins`), the MoE
    each slot's expert found on the device (`ExpertsGemm.separate`); its tokens are those of the
    joined GEMMs that training runs, the logits within the dtype's rounding
    (tests/model/test_compute_weights.py is the CPU version)."""
    from tests.helpers.tiny_model import tiny_model
    from tests.model.test_compute_weights import WeightConcatenations, every_group_joined, greedy

    model = tiny_model(use_moe=use_moe, num_experts=4, num_experts_per_tok=2).to("cuda", dtype)
    prompts = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(0)).cuda()
    with WeightConcatenations(model.parameters()) as separate:
        got = greedy(model, prompts, 5)
    with monkeypatch.context() as joined_anyway:
        every_group_joined(joined_anyway)
        with WeightConcatenations(model.parameters()) as joined:
            expected = greedy(model, prompts, 5)
    # 5 forwards (the prompt, 4 new tokens)
    assert (separate.count, joined.count) == (0, 5 * model.config.num_hidden_layers * groups)
    assert torch.equal(got.sequences, expected.sequences)
    rounding = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for logits, reference in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(logits, reference, rtol=0, atol=rounding * reference.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_moe_decode_step_routes_its_tokens_without_a_host_sync(monkeypatch, dtype):
    """An MoE block's decode step (3 tokens, no cast, no backward): the experts run one GEMM per
    matrix on every slot, each slot's expert found on the device (`ExpertsGemm.separate`), so no
    host sync on any GPU (the grouped GEMM's fallback outside bf16 on compute capability 9.x/10.x
    copies the group ends to the host); the output is the grouped GEMM's within rounding."""
    from model.compute_weights import block_weights
    from tests.helpers.tiny_model import tiny_model
    from tests.model.test_compute_weights import every_group_joined

    block = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2).model.layers[0].to("cuda", dtype)
    x = torch.randn(3, 1, block.mlp.gate.in_features, generator=torch.Generator().manual_seed(0)).to("cuda", dtype)
    with torch.no_grad():
        block.mlp(x, block_weights(block, dtype))  # CUDA/cuBLAS initialisation may synchronise once
        out, _ = without_host_sync(lambda: block.mlp(x, block_weights(block, dtype)))
        every_group_joined(monkeypatch)
        expected, _ = block.mlp(x, block_weights(block, dtype))
    rounding = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, expected, rtol=0, atol=rounding * expected.abs().max().item())
