"""model/compute_weights.py without a cast (FSDP's bf16 parameters, a bf16 or fp32 model): the joined
GEMMs save the parameters themselves, not their concatenation, and give autograd's gradients over
that concatenation bit for bit, eager and compiled; generation runs separate GEMMs, concatenating no
weights. With a cast: generation casts once."""

import json
import os
import subprocess

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class WeightConcatenations(TorchDispatchMode):
    """The concatenations dispatched inside it that read a matrix of `parameters` (a joined GEMM's
    weights), and the elements they write; and the GEMMs (mm, addmm, bmm, grouped)."""

    def __init__(self, parameters):
        super().__init__()
        self.weights = {p.untyped_storage().data_ptr() for p in parameters if p.dim() == 2}
        self.count = self.elements = self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and any(
                t.untyped_storage().data_ptr() in self.weights for t in args[0]):
            self.count += 1
            self.elements += out.numel()
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                   torch.ops.aten._grouped_mm):
            self.gemms += 1
        return out


def greedy(model, prompts, new_tokens, **inputs):
    """`new_tokens` greedy tokens after `prompts` (`inputs`: an attention mask), with their logits."""
    return model.generate(prompts, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **inputs)


def every_group_joined(monkeypatch) -> None:
    """Every group of weights without a cast runs as one GEMM, as in training (`joins`), fp32 q/k/v and
    gate/up excepted (those never join)."""
    from model import compute_weights, feed_forward

    monkeypatch.setattr(compute_weights.JoinedLinear, "joins", staticmethod(lambda x, w: w[0].dtype != torch.float32))
    monkeypatch.setattr(feed_forward.ExpertsGemm, "joins", staticmethod(lambda *args: True))


@pytest.mark.parametrize("use_moe, dtype, separate_gemms, joined_gemms, groups", [
    (False, torch.bfloat16, 7, 4, 2),  # q, k, v, o, gate, up, down; q/k/v and gate/up joined
    (True, torch.bfloat16, 17, 5, 3),  # q, k, v, o, the router and 4 experts x 3; q/k/v and the experts' two
    (True, torch.float32, 17, 7, 2),  # in fp32 only the experts' GEMMs are joined
])
def test_generation_without_a_cast_concatenates_no_weights_and_training_keeps_its_joined_gemms(
        monkeypatch, use_moe, dtype, separate_gemms, joined_gemms, groups):
    """A model in its compute dtype (`chat.py --dtype bfloat16`; an fp32 MoE, whose experts run one
    grouped GEMM): a decode step's q/k/v, gate/up and experts run as separate GEMMs, where the
    concatenation of each group would read and write most of the block's weights once more per new
    token. The same tokens as the joined GEMMs and the same logits within rounding (bit for bit in
    bf16 on a CPU, 1.2e-7 apart in fp32: a GEMM's order of sums may depend on its shape). A training
    forward/backward still joins every group: one concatenation per group each way."""
    model = tiny_model(use_moe=use_moe, num_experts=4, num_experts_per_tok=2).to(dtype)
    layers = model.config.num_hidden_layers
    prompts = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(0))
    with WeightConcatenations(model.parameters()) as separate:
        got = greedy(model, prompts, 5)
    assert (separate.count, separate.elements) == (0, 0)
    with monkeypatch.context() as joined_anyway:
        every_group_joined(joined_anyway)
        with WeightConcatenations(model.parameters()) as joined:
            expected = greedy(model, prompts, 5)
    # 5 forwards (the prompt, 4 new tokens), each with the LM head's GEMM
    assert (separate.gemms, joined.gemms) == (5 * (1 + layers * separate_gemms), 5 * (1 + layers * joined_gemms))
    assert joined.count == 5 * layers * groups
    assert torch.equal(got.sequences, expected.sequences)
    for logits, reference in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(logits, reference)
    ids = torch.randint(3, 97, (4, 64), generator=torch.Generator().manual_seed(1))
    with WeightConcatenations(model.parameters()) as training:
        out = model.train()(ids, labels=ids, skip_logits=True)
        (out.loss + out.aux_loss).backward()
    assert training.count == 2 * layers * groups  # each group once in the forward, once in the backward


def test_without_a_cast_a_group_is_joined_under_autograd_or_compile_or_where_it_moves_fewer_bytes():
    """q/k/v-like weights of 256 elements: separate GEMMs read the input twice more, the concatenation
    moves 512 elements, so without a backward 16 rows of 16 are joined and 15 not; fp32 never. The
    experts join from 65 rows. Recorded by autograd or compiled, any number of rows is joined."""
    weights = [torch.zeros(rows, 16, dtype=torch.bfloat16) for rows in (8, 4, 4)]
    experts = [torch.zeros(8, 16) for _ in range(4)]
    with torch.no_grad():
        assert not JoinedLinear.joins(torch.zeros(15, 16, dtype=torch.bfloat16), weights)
        assert JoinedLinear.joins(torch.zeros(1, 16, 16, dtype=torch.bfloat16), weights)
        assert not JoinedLinear.joins(torch.zeros(64, 16), [w.float() for w in weights])
        assert not ExpertsGemm.joins(torch.zeros(64, 16), experts, torch.tensor([32, 64], dtype=torch.int32))
        assert ExpertsGemm.joins(torch.zeros(65, 16), experts, torch.tensor([32, 65], dtype=torch.int32))
        compiled = torch.compile(lambda x: x + 1 if JoinedLinear.joins(x, weights) else x - 1, backend="eager",
                                 fullgraph=True)
        assert compiled(torch.zeros(1, 16, dtype=torch.bfloat16)).tolist() == [[1.0] * 16]
    row = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert JoinedLinear.joins(row.requires_grad_(), weights)
    assert JoinedLinear.joins(torch.zeros(1, 16, dtype=torch.bfloat16), [w.requires_grad_() for w in weights])
    assert ExpertsGemm.joins(torch.zeros(1, 16, requires_grad=True), experts, torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separate_expert_gemms_give_the_grouped_gemm_s_rows(dtype):
    """Three experts' gate/up (the second routed no row) run one GEMM per matrix on every row, each
    row taking its own expert's: the grouped GEMM's output, within rounding (a GEMM's kernel, and so
    the order of its sums, may depend on its shape: 1e-6 apart in fp32 on a CPU)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(7, 16, generator=generator).to(dtype)
    weights = [torch.randn(8, 16, generator=generator).to(dtype) for _ in range(6)]
    ends = torch.tensor([3, 3, 7], dtype=torch.int32)
    expected = ExpertsGemm.of(tokens, torch.cat(weights), ends)
    torch.testing.assert_close(ExpertsGemm.separate(tokens, weights, ends), expected)
