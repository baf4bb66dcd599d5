"""model/rope.py: the RoPE tables are fp32 buffers outside the state dict; YaRN stretches the low
frequencies; the rotation is the rotate-half form, in 5 passes over q or k each way."""

import math

import pytest
import torch

from model.rope import apply_rope, precompute_rope_tables, rope_rows, yarn_ramp, yarn_ramps_agree
from tests.helpers.tiny_model import tiny_config, tiny_model


def test_rope_buffers_are_non_persistent_and_survive_dtype_round_trip():
    model = tiny_model()
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"model.freqs_cos", "model.freqs_sin"}
    assert not any("freqs" in key for key in model.state_dict())
    assert not any("freqs" in name for name, _ in model.named_parameters())
    fresh_cos, fresh_sin = precompute_rope_tables(model.config)
    model.to(torch.bfloat16).to("cpu").to(torch.float32)
    assert model.model.freqs_cos.dtype == torch.float32
    assert torch.equal(model.model.freqs_cos, fresh_cos)
    assert torch.equal(model.model.freqs_sin, fresh_sin)
    model.to(torch.bfloat16)
    assert model.model.freqs_cos.dtype == torch.float32  # never rounded to bf16
    assert torch.equal(model.model.freqs_sin, fresh_sin)


def test_yarn_scaling_stretches_low_frequencies_only():
    plain_cos, plain_sin = precompute_rope_tables(tiny_config())
    yarn_config = tiny_config(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    cos, sin = precompute_rope_tables(yarn_config)
    scale = 0.1 * math.log(4.0) + 1.0  # YaRN's default attention factor
    assert torch.allclose(cos[0], torch.full_like(cos[0], scale))
    plain_angle = torch.atan2(plain_sin[1], plain_cos[1])  # = inverse frequency at position 1
    yarn_angle = torch.atan2(sin[1], cos[1])
    half = yarn_config.head_dim // 2
    # the fastest frequency is kept, the slowest is interpolated by `factor`
    assert yarn_angle[0].item() == pytest.approx(plain_angle[0].item(), rel=1e-5)
    assert yarn_angle[half - 1].item() == pytest.approx(plain_angle[half - 1].item() / 4.0, rel=1e-4)


def test_yarn_ramp_clamps_the_correction_range_as_minimind_or_as_transformers_does():
    """For these settings the correction range, frequency indices 5 to 12, runs past the last frequency (7):
    MiniMind clamps it at 7 (head_dim/2 - 1), transformers at 15 (head_dim - 1); a model's `ramp` says whose."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert torch.equal(yarn_ramp(16, 100.0, yarn), torch.tensor([0, 0, 0, 0, 0, 0, 1 / 2, 2 / 2]))
    assert torch.equal(yarn_ramp(16, 100.0, yarn, "transformers"), torch.tensor([0, 0, 0, 0, 0, 0, 1 / 7, 2 / 7]))
    assert torch.equal(yarn_ramp(16, 100.0, {**yarn, "ramp": "transformers"}),
                       yarn_ramp(16, 100.0, yarn, "transformers"))
    assert not yarn_ramps_agree(16, 100.0, yarn)
    assert yarn_ramps_agree(128, 1e6, {**yarn, "original_max_position_embeddings": 32768})  # Qwen3's own: range 20-40
    config = tiny_config(rope_theta=100.0, rope_scaling={**yarn, "ramp": "transformers"})
    cos, sin = precompute_rope_tables(config)
    rope = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 4096}
    reference = Qwen3Config(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                            head_dim=config.head_dim, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    assert torch.allclose(torch.atan2(sin[1], cos[1])[: config.head_dim // 2], inv_freq, rtol=1e-6, atol=0)
    assert cos[0, 0].item() == pytest.approx(attention_factor, rel=1e-7)


def rotate_half_reference(x, cos_table, sin_table, positions):
    """Qwen3's and Llama's expression, on the whole tables: x * cos + rotate_half(x) * sin."""
    cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_inputs(dtype, generator):
    cos_table, sin_table = precompute_rope_tables(tiny_config())  # head_dim 16 (tests/helpers/tiny_model.py)
    positions = torch.randint(0, cos_table.shape[0], (2, 7), generator=generator)
    x = torch.randn(2, 7, 3, cos_table.shape[1], generator=generator, dtype=torch.float64).to(dtype)
    return x, cos_table, sin_table, positions


def test_the_rotation_is_the_rotate_half_expression_and_its_gradient_the_inverse_rotation():
    generator = torch.Generator().manual_seed(0)
    x, cos_table, sin_table, positions = rope_inputs(torch.float64, generator)
    cos, sin = rope_rows(cos_table.double(), sin_table.double(), positions, torch.float64)
    expected = rotate_half_reference(x, cos_table.double(), sin_table.double(), positions)
    assert torch.allclose(apply_rope(x, cos, sin), expected, rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(lambda v: apply_rope(v, cos, sin), x.clone().requires_grad_())
    grad = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    rotated = x.clone().requires_grad_()
    apply_rope(rotated, cos, sin).backward(grad)
    # a rotation's transpose is its inverse: the gradient is the output's gradient rotated back
    # (to the fp32 tables' rounding: cos^2 + sin^2 of their values is 1 within about 1e-7)
    assert torch.allclose(apply_rope(rotated.grad, cos, sin), grad, rtol=0, atol=1e-6)


def test_the_bf16_rotation_is_no_further_from_the_exact_one_than_the_rotate_half_expression():
    generator = torch.Generator().manual_seed(1)
    x, cos_table, sin_table, positions = rope_inputs(torch.bfloat16, generator)
    exact = rotate_half_reference(x.double(), cos_table.double(), sin_table.double(), positions)
    cos, sin = rope_rows(cos_table, sin_table, positions, torch.bfloat16)
    expression = rotate_half_reference(x, cos_table.bfloat16(), sin_table.bfloat16(), positions)
    ours = apply_rope(x, cos, sin)
    assert ours.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() <= (expression.double() - exact).abs().max()


def test_the_rotation_moves_5_passes_of_its_input_each_way():
    """Counted by the step's byte counter (scripts/_step_bytes.py): forward, one product with cos
    (read x, write the result) and one fused multiply-add per half in place (read x's other half,
    read and write the result's half): 5 passes over x; the backward the same over the gradient.
    The rotate-half expression makes 4 ops and 9 passes each way."""
    from scripts._step_bytes import ByteCounter

    generator = torch.Generator().manual_seed(2)
    x, cos_table, sin_table, positions = rope_inputs(torch.bfloat16, generator)
    cos, sin = rope_rows(cos_table, sin_table, positions, torch.bfloat16)
    x.requires_grad_()
    grad = torch.ones_like(x)
    forward, backward = ByteCounter(), ByteCounter()
    with forward:
        out = apply_rope(x, cos, sin)
    with backward:
        out.backward(grad)
    table = sin.numel() * 2  # a half table of bf16 rows: cos (whole: two halves) read once, sin's half twice
    for counter in (forward, backward):
        read = sum(group.read for group in counter.groups.values())
        written = sum(group.written for group in counter.groups.values())
        calls = {name: group.calls for name, group in counter.groups.items()}
        assert calls == {"mul.Tensor": 1, "addcmul_": 2}
        assert (read, written) == (3 * x.numel() * 2 + 4 * table, 2 * x.numel() * 2)


def test_the_rotation_of_any_layout_and_its_gradient_are_the_expressions():
    """q and k as the attention reads them back (a transposed view), one new position (generation
    with a cache), and gradients of any strides (transposed, expanded): the rotate-half expression's
    values and gradients, in float64; the output is a tensor of its own, so it can be changed in place."""
    generator = torch.Generator().manual_seed(3)
    cos_table, sin_table = (t.double() for t in precompute_rope_tables(tiny_config()))
    for batch, length in ((2, 5), (3, 1)):
        positions = torch.randint(0, cos_table.shape[0], (batch, length), generator=generator)
        cos, sin = rope_rows(cos_table, sin_table, positions, torch.float64)
        x = torch.randn(batch, 3, length, cos_table.shape[1], generator=generator, dtype=torch.float64)
        x = x.transpose(1, 2).requires_grad_()  # [B, T, heads, D], not contiguous
        reference = x.detach().clone().requires_grad_()
        out, expected = apply_rope(x, cos, sin), rotate_half_reference(reference, cos_table, sin_table, positions)
        assert torch.allclose(out, expected, rtol=0, atol=1e-15)
        for grad in (torch.randn(batch, 3, length, cos_table.shape[1], generator=generator,
                                 dtype=torch.float64).transpose(1, 2),
                     torch.randn(1, 1, 1, cos_table.shape[1], generator=generator, dtype=torch.float64).expand_as(x)):
            got = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
            want = torch.autograd.grad(expected, reference, grad, retain_graph=True)[0]
            assert torch.allclose(got, want, rtol=0, atol=1e-15)
        doubled = apply_rope(x, cos, sin).mul_(2)  # a tensor of its own, not a view: changed in place
        assert torch.allclose(torch.autograd.grad(doubled.sum(), x)[0],
                              2 * torch.autograd.grad(expected.sum(), reference)[0], rtol=0, atol=1e-15)
