"""A tiny MiniMind model and packed rows, shared by the tests of model/ and of what runs it."""

import torch

from model import MiniMindConfig, MiniMindForCausalLM


def tiny_config(**overrides) -> MiniMindConfig:
    settings = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    settings.update(overrides)
    return MiniMindConfig(**settings)


def tiny_model(seed=0, **overrides) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(tiny_config(**overrides)).eval()


def packed_rows(lengths_per_row, row_len, seed=3):
    """Random packed rows: documents of the given lengths back to back, pads (position 0) after."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 97, (len(lengths_per_row), row_len))
    positions = torch.zeros_like(ids)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            positions[row, start:start + n] = torch.arange(n)
            start += n
        ids[row, start:] = 0
    return ids, positions
