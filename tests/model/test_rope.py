"""model/rope.py: the RoPE tables are fp32 buffers outside the state dict; YaRN stretches the low frequencies."""

import math

import pytest
import torch

from model.rope import precompute_rope_tables
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
