"""Rotary position embeddings: the cos/sin tables (plain, or YaRN-scaled for long contexts) and their
application to queries and keys."""

import math

import torch

from .configuration_minimind import MiniMindConfig


def precompute_rope_tables(config: MiniMindConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_position_embeddings, head_dim], always fp32.

    With `config.rope_yarn` (YaRN), frequencies whose wavelength is longer than the original
    context are interpolated by `factor`, short ones are kept, and a linear ramp blends the two
    bands between `beta_slow` and `beta_fast` rotations; the tables are scaled by the YaRN
    attention factor.
    """
    dim, base = config.head_dim, float(config.rope_theta)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (base**exponents)
    attention_factor = 1.0
    yarn = config.rope_yarn
    if yarn:
        factor = float(yarn["factor"])
        original = int(yarn["original_max_position_embeddings"])
        beta_fast = float(yarn.get("beta_fast", 32.0))
        beta_slow = float(yarn.get("beta_slow", 1.0))

        def dim_for_rotations(rotations: float) -> float:
            # The frequency index whose wavelength fits `rotations` times into the original context.
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_for_rotations(beta_fast)), 0)
        high = min(math.ceil(dim_for_rotations(beta_slow)), dim // 2 - 1)
        index = torch.arange(dim // 2, dtype=torch.float32, device=device)
        ramp = ((index - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        inv_freq = inv_freq * (1.0 - ramp) + (inv_freq / factor) * ramp
        attention_factor = float(yarn.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_rows(cos_table: torch.Tensor, sin_table: torch.Tensor, position_ids: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 tables' rows for `position_ids` [B, T], in `dtype`, for `apply_rope`: cos, and sin
    with its first half negated (so that rotating half of x needs no negation of x)."""
    cos, sin = cos_table[position_ids], sin_table[position_ids]
    half = sin.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos.to(dtype), signed_sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]; cos/signed_sin: [B, T, D] from `rope_rows`, in x's dtype.
    x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written as (x2, x1) * (-1, 1)."""
    cos, signed_sin = cos.unsqueeze(2), signed_sin.unsqueeze(2)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
