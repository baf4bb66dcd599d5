"""Map-style SFT datasets over the memory-mapped token cache: one sample per row, or packed rows."""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from model.loss import IGNORE_INDEX

from .rendering import check_tokenizer, load_tokenizer
from .node_build import prepare_cache
from .token_cache import default_cache_root, read_meta



def is_main_process() -> bool:
    """Global rank 0 (or not distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", 0)) == 0


class SFTDataset(Dataset):
    """Chat SFT samples with assistant-only labels, tokenized once into an on-disk cache.

    Args:
        data_path: jsonl file (MiniMind, ShareGPT or OpenAI lines, see ``dataset.formats``).
        tokenizer: a fast HF tokenizer with a chat template, or a tokenizer directory / ``None``
            (loaded with ``load_tokenizer``).
        max_seq_len: samples are truncated to this many tokens; a sample left without any loss
            token is dropped and counted in ``num_dropped``.
        bad_data: ``"error"`` raises ``DataError`` at the first bad line (``file:line: problem``);
            ``"skip"`` skips bad lines, counts them in ``num_skipped`` and prints one line.
        cache_dir: where the cache lives (default ``<data_file_dir>/.cache``).
        num_proc: tokenizer processes of the node when building (default: every core it may use; under
            torchrun the node's local ranks share them and build together, ``team_build``).
        augmenter: optional ``ChatAugmenter`` (``dataset.augment``) applied to each item, drawn from
            (its seed, the epoch set with ``set_epoch``, the index plus ``index_base``: the file's
            first sample among all files of a mixture); the cache does not depend on it.

    ``ds[i]`` is ``{"input_ids": int64 (L,), "labels": int64 (L,)}``; labels are the token ids
    where loss is taken and -100 elsewhere, unshifted. ``ds.lengths`` holds every sample's L.
    Memory per process is the offsets array; tokens and masks stay memory-mapped.
    """

    def __init__(
        self,
        data_path: str | Path,
        tokenizer,
        max_seq_len: int,
        bad_data: str = "error",
        cache_dir: str | Path | None = None,
        num_proc: int | None = None,
        augmenter=None,
    ):
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        check_tokenizer(tokenizer)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.data_path = Path(data_path)
        self.max_seq_len = max_seq_len
        self.pad_token_id = tokenizer.pad_token_id
        cache_root = default_cache_root(self.data_path, cache_dir)
        self.cache_path = prepare_cache(self.data_path, tokenizer, max_seq_len, cache_root, bad_data, num_proc)

        meta = read_meta(self.cache_path)
        # The content this dataset holds (sha256 of the file when its cache was built): the run's
        # identity (trainer/run_identity.py) takes it from here, never from the file again.
        self.data_digest: str = meta["data_digest"]  # every cache of this key records it
        self.num_skipped: int = meta["num_skipped"]
        self.num_dropped: int = meta["num_dropped"]
        self.num_tokens: int = meta["num_tokens"]
        self.token_dtype = np.dtype(meta["dtype"])
        self.offsets = np.load(self.cache_path / "offsets.npy")
        self.lengths = np.diff(self.offsets)
        self._tokens = None
        self._loss_mask = None
        self.augmenter = augmenter if augmenter is not None and augmenter.active else None
        self.epoch = 0
        self.index_base = 0
        if is_main_process() and (self.num_skipped or self.num_dropped):
            notes = []
            if self.num_skipped:
                notes.append(f"skipped {self.num_skipped} bad lines (first: {meta['first_bad_line']})")
            if self.num_dropped:
                notes.append(
                    f"dropped {self.num_dropped} samples with no loss tokens after truncation to max_seq_len={max_seq_len}"
                )
            print(f"[data] {self.data_path}: {len(self)} samples; " + "; ".join(notes))

    # The memmaps are opened lazily and not pickled, so DataLoader workers reopen them cheaply.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = state["_loss_mask"] = None
        return state

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.cache_path / "tokens.bin", dtype=self.token_dtype, mode="r")
        return self._tokens

    @property
    def loss_mask(self) -> np.memmap:
        if self._loss_mask is None:
            self._loss_mask = np.memmap(self.cache_path / "loss_mask.bin", dtype=np.uint8, mode="r")
        return self._loss_mask

    def __len__(self) -> int:
        return len(self.lengths)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the augmentations are drawn for (set before creating the epoch's iterator)."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.item(index, self.max_seq_len)

    def item(self, index: int, capacity: int) -> dict[str, np.ndarray]:
        """Sample ``index``; augmentations may add tokens up to ``capacity`` in all."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index = index % len(self)
        start, end = self.offsets[index], self.offsets[index + 1]
        input_ids = self.tokens[start:end].astype(np.int64)
        mask = self.loss_mask[start:end] != 0
        if self.augmenter is not None:
            input_ids, mask = self.augmenter.apply(input_ids, mask, self.epoch, self.index_base + index,
                                                  capacity - len(input_ids))
        return {"input_ids": input_ids, "labels": np.where(mask, input_ids, IGNORE_INDEX)}


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
    size). Items add ``position_ids`` that restart at 0 at every sample start; the model treats a
    position id of 0 as a document start and does not attend across documents. The first label
    of every sample is -100, so no loss crosses a boundary. ``lengths`` holds each row's tokens.
    """

    def __init__(self, dataset: SFTDataset, max_seq_len: int):
        self.dataset = dataset
        self.max_seq_len = max_seq_len
        self.row_offsets, self.items = pack_lengths(dataset.lengths, max_seq_len)
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

