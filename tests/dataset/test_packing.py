"""Packing on the demo set (dataset/packing.py): whole samples per row with their position ids, and
the padding that packing and length grouping leave against padding to ``max_seq_len``."""

from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from dataset import PackedSFTDataset, ResumableDistributedSampler, SFTCollator, build_cache_and_open
from tests.helpers.batches import pad_fraction


ROOT = Path(__file__).resolve().parents[2]
DEMO_TRAIN = ROOT / "dataset" / "demo" / "sft_train.jsonl"


@pytest.fixture(scope="module")
def demo_dataset(tokenizer, tmp_path_factory):
    return build_cache_and_open(DEMO_TRAIN, tokenizer, 512, cache_dir=tmp_path_factory.mktemp("demo_cache"))


def test_packing_rows(demo_dataset):
    packed = PackedSFTDataset(demo_dataset, 512)
    assert sorted(packed.items.tolist()) == list(range(len(demo_dataset)))
    assert packed.lengths.max() <= 512 and packed.lengths.sum() == demo_dataset.lengths.sum()
    r = int(np.flatnonzero(np.diff(packed.row_offsets) > 1)[0])  # the first row of several samples
    row = packed[r]
    members = packed.items[packed.row_offsets[r] : packed.row_offsets[r + 1]]
    starts = np.flatnonzero(row["position_ids"] == 0)
    assert starts.tolist() == np.concatenate([[0], np.cumsum(demo_dataset.lengths[members])[:-1]]).tolist()
    assert all(row["labels"][s] == -100 for s in starts)
    assert np.array_equal(row["input_ids"], np.concatenate([demo_dataset[i]["input_ids"] for i in members]))
    batch = SFTCollator(0)([packed[0], packed[1]])
    assert batch["position_ids"].shape == batch["input_ids"].shape


def test_dynamic_padding_and_packing_reduce_padding(demo_dataset):
    def fraction(ds, collator, batch_size, **sampler_args):
        sampler = ResumableDistributedSampler(len(ds), 1, 0, seed=0, **sampler_args)
        return pad_fraction(DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=collator))

    ds = demo_dataset
    pad_to_max = fraction(ds, SFTCollator(0, pad_to_length=512), 16)
    dynamic = fraction(ds, SFTCollator(0), 16)
    grouped = fraction(ds, SFTCollator(0), 16, lengths=ds.lengths, group_size=16)
    packed = fraction(PackedSFTDataset(ds, 512), SFTCollator(0), 4)
    print(f"pad fraction: max {pad_to_max:.3f} dynamic {dynamic:.3f} grouped {grouped:.3f} packed {packed:.3f}")
    assert pad_to_max > 0.5  # long tool conversations fill much of 512; most others are far shorter
    assert dynamic <= pad_to_max  # a batch of 16 nearly always holds a long tool conversation: close to max
    assert grouped < 0.1
    assert packed < 0.02
