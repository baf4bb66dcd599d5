"""Packing: several whole samples per row, a row at most ``max_seq_len`` tokens, documents kept apart."""

from __future__ import annotations

import bisect

import numpy as np
from torch.utils.data import Dataset

from model.loss import IGNORE_INDEX

from .sft_dataset import SFTDataset


def pack_lengths(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing bin packing of sample lengths into rows of at most ``capacity`` tokens.

    Deterministic (ties broken by sample index). Returns ``(row_offsets, items)``: row ``r``
    holds samples ``items[row_offsets[r]:row_offsets[r + 1]]`` in increasing index order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        raise ValueError(f"a sample of {lengths.max()} tokens does not fit a row of {capacity}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, then by index
    free: list[tuple[int, int]] = []  # sorted (free space, row id) of rows that still have room
    rows: list[list[int]] = []
    for index in order.tolist():
        length = int(lengths[index])
        position = bisect.bisect_left(free, (length, -1))
        if position < len(free):
            space, row = free.pop(position)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if space - length > 0:
            bisect.insort(free, (space - length, row))
    row_sizes = np.asarray([len(row) for row in rows], dtype=np.int64)
    row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(row_sizes, out=row_offsets[1:])
    items = np.concatenate([np.sort(row) for row in rows]) if rows else np.zeros(0, dtype=np.int64)
    return row_offsets, items.astype(np.int64)


class PackedSFTDataset(Dataset):
    """Rows of several whole samples of ``dataset``, at most ``max_seq_len`` tokens each.

    Rows come from ``pack_lengths`` (computed once from ``dataset.lengths``, independent of world
    size; with a system prompt augmentation, from each sample's length plus the room a prompt may add
    to it, ``prompt_room``, so every drawn prompt that fits ``max_seq_len`` fits its row). Items add
    ``position_ids`` that restart at 0 at every sample start; the model treats a position id of 0 as
    a document start and does not attend across documents. The first label of every sample is -100,
    so no loss crosses a boundary. ``lengths`` holds each row's tokens (as cached); the rows hold
    that room already, so ``prompt_room`` is None.
    """

    prompt_room = None

    def __init__(self, dataset: SFTDataset, max_seq_len: int):
        self.dataset = dataset
        self.max_seq_len = max_seq_len
        room = dataset.prompt_room  # a drawn system prompt fits its sample's row wherever it fits max_seq_len
        planned = dataset.lengths if room is None else np.asarray(dataset.lengths) + np.maximum(room, 0)
        self.row_offsets, self.items = pack_lengths(planned, max_seq_len)
        sample_lengths = np.asarray(dataset.lengths, dtype=np.int64)[self.items]
        row_sums = np.add.reduceat(sample_lengths, self.row_offsets[:-1]) if len(self.items) else sample_lengths
        self.lengths = row_sums.astype(np.int64)

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows")
        index = index % len(self)
        members = self.items[self.row_offsets[index] : self.row_offsets[index + 1]]
        room = self.max_seq_len - int(self.lengths[index])  # what augmentations may add to this row
        samples = []
        for i in members:
            capacity = int(self.dataset.lengths[i]) + room
            samples.append(self.dataset.item(i, capacity))
            room = capacity - len(samples[-1]["input_ids"])
        for sample in samples:
            sample["labels"][0] = IGNORE_INDEX
        return {
            "input_ids": np.concatenate([s["input_ids"] for s in samples]),
            "labels": np.concatenate([s["labels"] for s in samples]),
            "position_ids": np.concatenate([np.arange(len(s["input_ids"]), dtype=np.int64) for s in samples]),
        }

