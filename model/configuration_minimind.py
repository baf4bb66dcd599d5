"""Configuration of the MiniMind decoder.

A plain `transformers.PretrainedConfig`, so `save_pretrained` / `from_pretrained` and the
Auto classes work on it. Derived sizes (`head_dim`, `intermediate_size`) are filled in at
construction and invalid combinations fail right here with a `ValueError`, not later with a
shape error deep inside a matmul.

Defaults are MiniMind's (model/model_minimind.py of jingyaogong/minimind): `rms_norm_eps`
1e-6, MoE with 1 expert per token and aux-loss coefficient 5e-4, so a MiniMind `.pth` loads
with no extra settings. `head_dim` may differ from hidden_size / num_attention_heads (as in
Qwen3); only a derived head_dim needs the heads to divide the width.
"""

import math

from transformers import PretrainedConfig

# Whose YaRN ramp `rope_scaling["ramp"]` names (model/rope.py, `yarn_ramp`): MiniMind's where the key
# is absent (MiniMind's own weights), transformers' for a model read from a Qwen3 directory whose
# settings tell the two apart.
YARN_RAMPS = ("minimind", "transformers")
# YaRN's rotation counts where the settings leave them out (or null): the paper's, MiniMind's and transformers'.
YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}


def is_number(value) -> bool:
    """A finite int or float: not a bool, a string, None, inf or nan."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The switches of the config: each a JSON true or false.
BOOL_FIELDS = ("flash_attn", "tie_word_embeddings", "use_moe", "norm_topk_prob")


def is_bool(value) -> bool:
    """True or False: not a string (any non-empty one, "false" too, is truthy), not 0 or 1 (transformers'
    Qwen3 config refuses them for its switches), not None."""
    return isinstance(value, bool)


def yarn_beta(yarn: dict, key: str) -> float:
    """`beta_fast` or `beta_slow` of YaRN settings, YARN_BETAS's where absent or null."""
    value = yarn.get(key)
    return float(YARN_BETAS[key] if value is None else value)


def yarn_factor(yarn: dict, positions=None):
    """YaRN's stretch of the context: the settings' `factor`; where that is given as null in the settings of a
    config transformers reads, whose max_position_embeddings is `positions`, transformers' own
    (`_compute_yarn_parameters`): positions / original_max_position_embeddings (None where either is no
    positive number). Without `positions` (MiniMind's and minisft's own settings) null stays None."""
    factor, original = yarn.get("factor"), yarn.get("original_max_position_embeddings")
    computable = is_number(positions) and positions > 0 and is_number(original) and original > 0
    if factor is None and "factor" in yarn and computable:
        return positions / original
    return factor


def rope_problem(rope_theta, yarn, key: str = "rope_scaling", positions=None) -> str | None:
    """Why the RoPE base `rope_theta` and the YaRN settings `yarn` (None: plain RoPE) cannot make the
    tables (model/rope.py), as part of a line; None when they can. `key` names the settings as their
    config does (rope_scaling, MiniMind's; rope_yarn, a saved minisft config's; rope_parameters, a Qwen3
    config.json's); `positions` is the max_position_embeddings of a config transformers reads, from which
    it computes a null factor (`yarn_factor`).

    Accepted are the values transformers' YaRN (`_compute_yarn_parameters`) computes with, and with
    transformers' ramp (`yarn_ramp`) the tables are its tables. Refused are those its
    `_validate_yarn_rope_parameters` calls wrong (factor below 1, attention_factor below 0), a factor
    transformers requires and does not find (no key) and those that make no usable table: a missing or
    non-positive original context, a non-positive rotation count (transformers reads a beta of 0 as its
    default), attention_factor 0 (every table 0), and base 1 (the correction range divides by
    log(rope_theta)). beta_fast below beta_slow is accepted, as transformers accepts it (`yarn_ramp` says
    what each ramp makes of it)."""
    if not (is_number(rope_theta) and rope_theta > 0):
        return f"rope_theta must be a positive number, got {rope_theta!r}"
    if yarn is None:
        return None
    if not isinstance(yarn, dict):
        return f"{key} must be a dict, got {yarn!r}"
    kind = yarn.get("type", yarn.get("rope_type"))
    if kind != "yarn":
        return f"only YaRN {key} is supported, got type {kind!r}"
    if "original_max_position_embeddings" not in yarn:
        return f"{key} has no original_max_position_embeddings (the context the model was trained for)"
    original = yarn["original_max_position_embeddings"]
    if not (is_number(original) and original > 0):
        return f"{key}['original_max_position_embeddings'] must be a positive number, got {original!r}"
    factor = yarn_factor(yarn, positions)
    if not (is_number(factor) and factor >= 1):
        if yarn.get("factor") is None and factor is not None:  # transformers' factor of a null one
            return (f"{key}['factor'] is null, for which transformers computes max_position_embeddings / "
                    f"original_max_position_embeddings = {positions!r} / {original!r} = {factor:g}: it must be >= 1 "
                    "(the context's stretch)")
        if "factor" not in yarn:
            return f"{key} has no factor (the context's stretch)"
        return f"{key}['factor'] must be a number >= 1 (the context's stretch), got {factor!r}"
    for name, default in YARN_BETAS.items():
        value = yarn.get(name)
        if value is not None and not (is_number(value) and value > 0):
            zero = f" (transformers reads 0 as its default, {default:g}: give {default:g} or leave it out)"
            return f"{key}['{name}'] must be a positive number, got {value!r}" + (zero if value == 0 else "")
    scale = yarn.get("attention_factor")
    if scale is not None and not (is_number(scale) and scale > 0):
        zero = " (it scales the cos/sin tables: 0 makes them 0)" if scale == 0 else ""
        return f"{key}['attention_factor'] must be a positive number, got {scale!r}{zero}"
    if rope_theta == 1:
        return f"{key} (YaRN) needs rope_theta other than 1: its correction range divides by log(rope_theta)"
    if yarn.get("ramp", YARN_RAMPS[0]) not in YARN_RAMPS:
        return f"{key}['ramp'] must be one of {', '.join(YARN_RAMPS)}, got {yarn['ramp']!r}"
    return None


class MiniMindConfig(PretrainedConfig):
    model_type = "minimind"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 6400,
        hidden_size: int = 768,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 32768,
        rope_theta: float = 1e6,
        rope_scaling: dict | None = None,
        rms_norm_eps: float = 1e-6,
        dropout: float = 0.0,
        flash_attn: bool = True,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        use_moe: bool = False,
        num_experts: int = 4,
        num_experts_per_tok: int = 1,
        moe_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        router_aux_loss_coef: float = 5e-4,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        # transformers 5 reserves `config.rope_scaling` for its own RoPE machinery, so the
        # YaRN settings (MiniMind's `rope_scaling` argument) are stored as `rope_yarn`.
        self.rope_yarn = rope_scaling if rope_scaling is not None else kwargs.pop("rope_yarn", None)
        yarn_key = "rope_scaling" if rope_scaling is not None else "rope_yarn"
        self.rms_norm_eps = rms_norm_eps
        self.dropout = dropout
        self.flash_attn = flash_attn
        self.initializer_range = initializer_range
        self.use_moe = use_moe
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        self._fill_derived_sizes()
        self._validate(head_dim_derived=head_dim is None, yarn_key=yarn_key, tie_word_embeddings=tie_word_embeddings)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def _fill_derived_sizes(self) -> None:
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            # MiniMind's rule: about pi * hidden, rounded up to a multiple of 64.
            self.intermediate_size = math.ceil(self.hidden_size * math.pi / 64) * 64
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size

    def _validate(self, head_dim_derived: bool, yarn_key: str, tie_word_embeddings) -> None:
        for name in BOOL_FIELDS:  # tie_word_embeddings is set by PretrainedConfig, after this check
            value = tie_word_embeddings if name == "tie_word_embeddings" else getattr(self, name)
            if not is_bool(value):
                raise ValueError(f"MiniMindConfig: {name} must be true or false (a JSON bool), got {value!r}")
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "max_position_embeddings",
        ) + (("num_experts", "num_experts_per_tok") if self.use_moe else ())
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MiniMindConfig: {name} must be a positive integer, got {value!r}")
        if head_dim_derived and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"MiniMindConfig: num_attention_heads ({self.num_attention_heads}) must divide "
                f"hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"MiniMindConfig: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"MiniMindConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if not (is_number(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ValueError(f"MiniMindConfig: rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        for name in ("router_aux_loss_coef", "initializer_range"):  # a loss weight, a standard deviation
            value = getattr(self, name)
            if not (is_number(value) and value >= 0):
                raise ValueError(f"MiniMindConfig: {name} must be a number >= 0, got {value!r}")
        if not (is_number(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"MiniMindConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if self.use_moe and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"MiniMindConfig: num_experts_per_tok ({self.num_experts_per_tok}) must be "
                f"between 1 and num_experts ({self.num_experts})"
            )
        problem = rope_problem(self.rope_theta, self.rope_yarn, yarn_key)
        if problem:
            raise ValueError(f"MiniMindConfig: {problem}")
