"""What the tests measure of collated batches."""

from collections.abc import Iterable

import torch


def pad_fraction(batches: Iterable[dict[str, torch.Tensor]]) -> float:
    """Fraction of padded positions (attention_mask == 0) over all positions of the batches."""
    padded = total = 0
    for batch in batches:
        mask = batch["attention_mask"]
        padded += int((mask == 0).sum())
        total += mask.numel()
    return padded / total if total else 0.0
