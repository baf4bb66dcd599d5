"""Parameter counting; `python -m model` prints the default config's size."""

from torch import nn


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

