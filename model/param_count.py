"""Parameter counting; `python -m model` prints the default config's size."""

import copy

import torch
from torch import nn

from .modeling_minimind import MiniMindForCausalLM


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Unique trainable parameters (a tied LM head counts once), split by role."""
    seen, counts = set(), {"embedding": 0, "attention": 0, "mlp": 0, "norm": 0, "lm_head": 0}
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if "embed_tokens" in name:
            role = "embedding"
        elif "lm_head" in name:
            role = "lm_head"
        elif "norm" in name:
            role = "norm"
        elif "self_attn" in name:
            role = "attention"
        else:
            role = "mlp"
        counts[role] += param.numel()
    counts["total"] = sum(counts.values())
    return counts


def format_parameter_count(model: nn.Module) -> str:
    counts = count_parameters(model)
    parts = ", ".join(f"{role} {n / 1e6:.3f}M" for role, n in counts.items() if role != "total" and n)
    return f"{counts['total'] / 1e6:.3f}M parameters ({parts})"



def count_config_parameters(config) -> int:
    """The parameters of the model `config` (a MiniMindConfig) describes, counted on the meta device
    (nothing allocated) at one and two layers: every block has the same parameters, so the rest
    follow without building a deep model."""
    counts = []
    for layers in (1, 2):
        shallow = copy.deepcopy(config)
        shallow.num_hidden_layers = layers
        with torch.device("meta"):
            counts.append(count_parameters(MiniMindForCausalLM(shallow))["total"])
    return counts[0] + (config.num_hidden_layers - 1) * (counts[1] - counts[0])
