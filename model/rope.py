"""Rotary position embeddings: the cos/sin tables (plain, or YaRN-scaled for long contexts) and their
application to queries and keys."""

import math

import torch
from torch.autograd.function import once_differentiable

from .configuration_minimind import MiniMindConfig, yarn_beta


def precompute_rope_tables(config: MiniMindConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_position_embeddings, head_dim], always fp32.

    With `config.rope_yarn` (YaRN), frequencies whose wavelength is longer than the original
    context are interpolated by `factor`, short ones are kept, and a linear ramp (`yarn_ramp`)
    blends the two bands between `beta_slow` and `beta_fast` rotations; the tables are scaled by
    the YaRN attention factor.
    """
    dim, base = config.head_dim, float(config.rope_theta)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (base**exponents)
    attention_factor = 1.0
    yarn = config.rope_yarn
    if yarn:
        factor = float(yarn["factor"])
        ramp = yarn_ramp(dim, base, yarn, device=device)
        inv_freq = inv_freq * (1.0 - ramp) + (inv_freq / factor) * ramp
        given = yarn.get("attention_factor")  # absent or null: YaRN's, from the factor
        attention_factor = float(given) if given is not None else 0.1 * math.log(factor) + 1.0
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def yarn_ramp(dim: int, base: float, yarn: dict, ramp: str | None = None, device=None) -> torch.Tensor:
    """YaRN's blend of each of the `dim // 2` frequencies (0: kept, 1: divided by `factor`), linear
    across the correction range: from the frequency index that fits `beta_fast` rotations into the
    original context to the one that fits `beta_slow`, rounded outwards. `ramp` (YARN_RAMPS; None:
    the settings' own "ramp", absent for MiniMind's) names whose clamp of the range's upper end:
    MiniMind's is the last frequency, dim // 2 - 1 (an empty or inverted range: a step at its lower
    end); transformers' (and llama.cpp's) is dim - 1, so a range that runs past the last frequency
    gives a shallower ramp, and transformers divides by an inverted range as it is."""
    original = float(yarn["original_max_position_embeddings"])
    beta_fast, beta_slow = yarn_beta(yarn, "beta_fast"), yarn_beta(yarn, "beta_slow")

    def dim_for_rotations(rotations: float) -> float:
        # The frequency index whose wavelength fits `rotations` times into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for_rotations(beta_fast)), 0)
    if (ramp or yarn.get("ramp")) == "transformers":
        high = min(math.ceil(dim_for_rotations(beta_slow)), dim - 1)
        width = (high - low) or 1e-3
    else:
        high = min(math.ceil(dim_for_rotations(beta_slow)), dim // 2 - 1)
        width = max(high - low, 1e-3)
    index = torch.arange(dim // 2, dtype=torch.float32, device=device)
    return ((index - low) / width).clamp(0.0, 1.0)


def yarn_ramps_agree(dim: int, base: float, yarn: dict) -> bool:
    """Whether MiniMind's and transformers' YaRN ramps (`yarn_ramp`) are the same for these
    settings: they are unless the correction range reaches past the last frequency."""
    return torch.equal(yarn_ramp(dim, base, yarn, "minimind"), yarn_ramp(dim, base, yarn, "transformers"))


def rope_rows(cos_table: torch.Tensor, sin_table: torch.Tensor, position_ids: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 tables' rows for `position_ids` [B, T], in `dtype`, for `apply_rope`: cos [B, T, D]
    and the first half of sin [B, T, D/2] (a table's two halves are equal: each frequency's angle is
    in both)."""
    half = sin_table.shape[-1] // 2
    return cos_table[position_ids].to(dtype), sin_table[:, :half][position_ids].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]; cos [B, T, D] and sin [B, T, D/2] from `rope_rows`, in x's dtype. Rotates
    each pair (x1, x2) of x's halves by its position's angle: (x1 cos - x2 sin, x2 cos + x1 sin), the
    rotate-half form of Qwen3 and Llama (x * cos + rotate_half(x) * sin).

    Eagerly one autograd node: each way, one product with cos and a fused multiply-add per half,
    in place: 3 kernels and 5 passes over x where the rotate-half expression makes 4 and 9 (a roll,
    two products, a sum); its backward keeps no copy of x. torch.compile traces the node whole (no
    graph break), for inductor to fuse."""
    return _Rotation.apply(x, cos.unsqueeze(2), sin.unsqueeze(2))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x's halves rotated by the angle (sign 1) or back by it (sign -1: the transpose, the gradient):
    x times cos in one product (a tensor of its own, not a view), then each half's sine term added
    in place."""
    out = x * cos
    (x1, x2), (out1, out2) = x.chunk(2, dim=-1), out.chunk(2, dim=-1)
    out1.addcmul_(x2, sin, value=-sign)
    out2.addcmul_(x1, sin, value=sign)
    return out


class _Rotation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None
