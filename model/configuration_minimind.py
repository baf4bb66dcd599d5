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
        self._validate(head_dim_derived=head_dim is None)
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

    def _validate(self, head_dim_derived: bool) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
        )
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
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"MiniMindConfig: rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not (isinstance(self.router_aux_loss_coef, (int, float)) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"MiniMindConfig: router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MiniMindConfig: dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0:
            raise ValueError(f"MiniMindConfig: rope_theta must be positive, got {self.rope_theta}")
        if self.use_moe:
            if self.num_experts < 1:
                raise ValueError(f"MiniMindConfig: num_experts must be >= 1, got {self.num_experts}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"MiniMindConfig: num_experts_per_tok ({self.num_experts_per_tok}) must be "
                    f"between 1 and num_experts ({self.num_experts})"
                )
        if self.rope_yarn is not None:
            if not isinstance(self.rope_yarn, dict):
                raise ValueError(f"MiniMindConfig: rope_scaling must be a dict, got {self.rope_yarn!r}")
            kind = self.rope_yarn.get("type", self.rope_yarn.get("rope_type"))
            if kind != "yarn":
                raise ValueError(f"MiniMindConfig: only YaRN rope_scaling is supported, got type {kind!r}")
            if float(self.rope_yarn.get("factor", 0)) <= 1.0:
                raise ValueError("MiniMindConfig: rope_scaling['factor'] must be > 1")
            if int(self.rope_yarn.get("original_max_position_embeddings", 0)) <= 0:
                raise ValueError("MiniMindConfig: rope_scaling needs original_max_position_embeddings > 0")
            if self.rope_yarn.get("ramp", YARN_RAMPS[0]) not in YARN_RAMPS:
                raise ValueError(f"MiniMindConfig: rope_scaling['ramp'] must be one of {', '.join(YARN_RAMPS)}, "
                                 f"got {self.rope_yarn['ramp']!r}")
