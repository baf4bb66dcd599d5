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


def test_a_configs_parameters_counted_from_two_layers_are_the_built_models():
    for overrides in ({}, {"use_moe": True}, {"num_hidden_layers": 3, "tie_word_embeddings": False}):
        config = MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **overrides)
        assert count_config_parameters(config) == count_parameters(MiniMindForCausalLM(config))["total"]
