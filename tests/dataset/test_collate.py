"""Batch collation (dataset/collate.py): right padding to the longest row, a multiple or a fixed
length, and the pad fraction."""

import numpy as np
import pytest
import torch

from dataset import SFTCollator
from tests.helpers.batches import pad_fraction


def test_collator_right_pads_to_longest_or_fixed_length():
    items = [
        {"input_ids": np.array([5, 6, 7]), "labels": np.array([-100, 6, 7])},
        {"input_ids": np.array([8]), "labels": np.array([8])},
    ]
    batch = SFTCollator(pad_token_id=0)(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    assert SFTCollator(0, pad_to_multiple_of=8, max_length=16)(items)["input_ids"].shape == (2, 8)
    assert SFTCollator(0, pad_to_multiple_of=8, max_length=5)(items)["input_ids"].shape == (2, 5)  # never past it
    assert SFTCollator(0, pad_to_multiple_of=8, max_length=2)(items)["input_ids"].shape == (2, 3)  # nor cut
    with pytest.raises(ValueError, match="pad_to_multiple_of needs max_length"):
        SFTCollator(0, pad_to_multiple_of=8)
    assert SFTCollator(0, pad_to_length=16)(items)["labels"].shape == (2, 16)
    assert pad_fraction([batch]) == pytest.approx(2 / 6)
