"""model/compute_weights.py without a cast (FSDP's bf16 parameters, a bf16 or fp32 model): the joined
GEMMs save the parameters themselves, not their concatenation, and give autograd's gradients over
that concatenation bit for bit, eager and compiled. With a cast: generation casts once."""

import json
import os
import subprocess

import pytest
import torch

from model.compute_weights import JoinedLinear, linear_gradients_op
from model.feed_forward import ExpertsGemm
from tests.helpers.saved_weights import saved_by, saved_parameters, weight_copies
from tests.helpers.tiny_model import tiny_model
from tests.helpers.trainer_launch import REPO, clean_env, torchrun_cmd


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("use_moe", [False, True])
def test_joined_gemms_of_bf16_parameters_save_the_parameters_and_no_copy_of_them(use_moe, backend):
    """A saved concatenation (q/k/v, gate/up, every expert's matrices) would stay allocated from a
    block's forward to its backward, beside the parameters that FSDP frees after the forward. Each
    block compiled as the trainer compiles it, or eager."""
    model = tiny_model(use_moe=use_moe, num_experts=4, num_experts_per_tok=2).train().to(torch.bfloat16)
    if backend is not None:
        torch._dynamo.reset()
        for block in model.model.layers:
            block.compile(backend=backend)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    out, saved = saved_by(lambda: model(ids, labels=ids, skip_logits=True))
    weights = {name: p.detach() for name, p in model.named_parameters() if p.dim() == 2}
    assert weight_copies(saved, weights, model.parameters()) == []
    assert saved_parameters(saved, model.named_parameters()) == sorted(name for name, _ in model.named_parameters())


def joined_gemm_case(gemm, dtype):
    """(a, extra, weights) of a small GEMM of `gemm`: q/k/v-like for JoinedLinear, two experts'
    gate/up for ExpertsGemm."""
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    if gemm is JoinedLinear:
        return tensor(2, 5, 16), (), [tensor(8, 16), tensor(4, 16), tensor(4, 16)]
    return tensor(8, 16), (torch.tensor([3, 8], dtype=torch.int32),), [tensor(8, 16) for _ in range(4)]


@pytest.mark.parametrize("backend", [None, "eager", "aot_eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemm", [JoinedLinear, ExpertsGemm])
def test_a_joined_gemm_equals_autograd_over_the_concatenation_bit_for_bit(gemm, dtype, backend):
    a, extra, weights = joined_gemm_case(gemm, dtype)
    grad = torch.randn(gemm.of(a, torch.cat(weights), *extra).shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = gemm.of(a, torch.cat(weights), *extra)
    expected_grads = torch.autograd.grad(expected, [a, *weights], grad)
    run = gemm.apply if backend is None else torch.compile(gemm.apply, backend=backend, fullgraph=True)
    torch._dynamo.reset()
    got = run(a, *extra, *weights)
    got_grads = torch.autograd.grad(got, [a, *weights], grad)
    assert torch.equal(got, expected)
    assert all(torch.equal(g, e) for g, e in zip(got_grads, expected_grads, strict=True))


@pytest.mark.slow
def test_fsdp_bf16_keeps_no_copy_of_a_block_s_weights_from_its_forward_to_its_backward():
    """Two gloo processes, FSDP2 with bf16 parameters: after the forward every saved weight of a
    block is its parameter, whose memory FSDP has freed (11 per dense block, 21 per MoE block)."""
    result = subprocess.run([*torchrun_cmd(2), os.path.join(REPO, "tests", "helpers", "fsdp_saved_check.py")],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"dense": {"copies": [], "freed": 22},
                                                                  "moe": {"copies": [], "freed": 42}}


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_the_joined_linear_gradients_op_passes_torchs_custom_op_checks(needs):
    x, _, weights = joined_gemm_case(JoinedLinear, torch.float32)
    grad = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    arguments = (grad, x.detach(), [w.detach() for w in weights], *needs)
    results = torch.library.opcheck(linear_gradients_op, arguments)
    assert set(results.values()) == {"SUCCESS"} and len(results) == 4


@pytest.mark.parametrize("use_moe", [False, True])
def test_generation_casts_each_blocks_weights_once_for_all_its_tokens(monkeypatch, use_moe):
    """fp32 weights under bf16 autocast (the trainer's evaluation): `generate` makes each block's cast
    weights once, not once per new token, with the same tokens and logits, bit for bit; outside it,
    every forward casts afresh (the weights may have changed)."""
    from transformers import GenerationMixin

    from model import compute_weights

    model = tiny_model(use_moe=use_moe)
    prompts = torch.randint(3, 97, (2, 6))
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    made, original = [], compute_weights.ComputeWeights

    def counted(*args):
        made.append(args[1])
        return original(*args)

    monkeypatch.setattr(compute_weights, "ComputeWeights", counted)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = model.generate(prompts, **kwargs)
        assert made == [torch.bfloat16] * model.config.num_hidden_layers
        made.clear()
        fresh = GenerationMixin.generate(model, prompts, **kwargs)  # a cast per forward: the prompt, 4 tokens
        assert made == [torch.bfloat16] * model.config.num_hidden_layers * 5
        made.clear()
        model(prompts)
        model(prompts)
    assert made == [torch.bfloat16] * model.config.num_hidden_layers * 2
    assert torch.equal(kept.sequences, fresh.sequences)
    assert all(torch.equal(a, b) for a, b in zip(kept.logits, fresh.logits))
    assert all(block.kept_weights is None for block in model.model.layers)
