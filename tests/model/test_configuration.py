"""model/configuration_minimind.py and model/param_count.py: the default size and refused settings."""

import subprocess
import sys

import pytest

from model import MiniMindConfig, MiniMindForCausalLM, count_config_parameters, count_parameters
from tests.helpers.tiny_model import tiny_config
from tests.helpers.trainer_launch import REPO


def test_default_parameter_count_matches_hand_count(capsys):
    config = MiniMindConfig()
    assert (config.head_dim, config.intermediate_size) == (96, 2432)  # ceil(768*pi/64)*64
    hidden, layers, vocab, inter, head_dim = 768, 8, 6400, 2432, 96
    kv = 4 * head_dim
    attention = hidden * hidden * 2 + hidden * kv * 2  # q, o + k, v
    mlp = 3 * hidden * inter
    norms = 2 * hidden + 2 * head_dim  # two block norms + q/k norms
    hand = vocab * hidden + layers * (attention + mlp + norms) + hidden  # tied head counted once
    assert hand == 63_912_192
    assert count_parameters(MiniMindForCausalLM(config))["total"] == hand
    out = subprocess.run([sys.executable, "-m", "model"], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("63.912M parameters")


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(hidden_size=66, num_attention_heads=4), "must divide hidden_size"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "must divide num_attention_heads"),
        (dict(use_moe=True, num_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(rope_scaling={"type": "linear", "factor": 2}), "only YaRN"),
        (dict(rope_scaling={"type": "yarn", "factor": 2, "original_max_position_embeddings": 16, "ramp": "llama"}),
         r"^MiniMindConfig: rope_scaling\['ramp'\] must be one of minimind, transformers, got 'llama'$"),
    ],
)
def test_invalid_config_raises_clear_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**bad)


@pytest.mark.parametrize("bad, message", [
    (dict(use_moe=True, moe_intermediate_size=0), "moe_intermediate_size must be a positive integer, got 0"),
    (dict(use_moe=True, num_experts=2.5), "num_experts must be a positive integer, got 2.5"),
    (dict(use_moe=True, num_experts_per_tok="1"), "num_experts_per_tok must be a positive integer, got '1'"),
    (dict(rope_theta=float("nan")), "rope_theta must be a positive number, got nan"),
    (dict(rope_theta="1e6"), "rope_theta must be a positive number, got '1e6'"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a positive number, got inf"),
    (dict(router_aux_loss_coef=float("inf")), "router_aux_loss_coef must be a number >= 0, got inf"),
    (dict(initializer_range=-0.02), "initializer_range must be a number >= 0, got -0.02"),
    (dict(dropout="0.1"), "dropout must be in [0, 1), got '0.1'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "beta_fast": "32"}),
     "rope_scaling['beta_fast'] must be a positive number, got '32'"),
])
def test_a_number_no_model_can_have_is_refused_by_name(bad, message):
    """Each would otherwise fail inside torch (a tensor size, a std, topk's k) or train a broken model."""
    with pytest.raises(ValueError) as refused:
        tiny_config(**bad)
    assert str(refused.value) == f"MiniMindConfig: {message}"


@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", "false"), ("use_moe", "true"), ("flash_attn", "no"), ("norm_topk_prob", 0),
    ("use_moe", 1), ("tie_word_embeddings", None),
])
def test_a_switch_that_is_not_true_or_false_is_refused_by_name(field, value):
    """A non-empty string is truthy ("false" would mean True) and transformers' Qwen3 config refuses 0 and 1."""
    with pytest.raises(ValueError) as refused:
        tiny_config(**{field: value})
    assert str(refused.value) == f"MiniMindConfig: {field} must be true or false (a JSON bool), got {value!r}"


def test_a_configs_parameters_counted_from_two_layers_are_the_built_models():
    for overrides in ({}, {"use_moe": True}, {"num_hidden_layers": 3, "tie_word_embeddings": False}):
        config = MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **overrides)
        assert count_config_parameters(config) == count_parameters(MiniMindForCausalLM(config))["total"]
