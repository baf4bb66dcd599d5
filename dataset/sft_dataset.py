"""The map-style SFT dataset over a file's token cache: one sample per row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from model.loss import IGNORE_INDEX

from .cache import build_or_reuse, default_cache_root, open_finished
from .rendering import check_tokenizer, load_tokenizer


class SFTDataset(Dataset):
    """Chat SFT samples with assistant-only labels, from the file's token cache (``dataset.cache``).

    It opens the finished cache of (file, tokenizer, ``max_seq_len``) and builds nothing: where none
    is finished, it raises ``cache.CacheNotBuilt``. It runs no collective. The cache is built by a
    step before: the training script's data setup builds every file's cache with the node's ranks
    (``trainer/data_setup.build_token_caches``); ``build_cache_and_open`` builds it in this process
    (``cache.build_or_reuse``), then opens it.

    Args:
        data_path: jsonl file (MiniMind, ShareGPT or OpenAI lines, see ``dataset.formats``).
        tokenizer: a fast HF tokenizer with a chat template, or a tokenizer directory / ``None``
            (loaded with ``load_tokenizer``).
        max_seq_len: samples are truncated to this many tokens; a sample left without any loss
            token is dropped and counted in ``num_dropped``.
        bad_data: ``"error"`` raises ``DataError`` for a cache that skipped bad lines (its first bad
            line, ``file:line: problem``); ``"skip"`` counts them in ``num_skipped`` and prints one line.
        cache_dir: where the cache lives (default ``<data_file_dir>/.cache``).
        augmenter: optional ``ChatAugmenter`` (``dataset.augment``) applied to each item, drawn from
            (its seed, the epoch set with ``set_epoch``, the index plus ``index_base``: the file's
            first sample among all files of a mixture); the cache does not depend on it.
        log: where the line about skipped and dropped samples goes (``print``; a no-op on all ranks but 0).

    ``ds[i]`` is ``{"input_ids": int64 (L,), "labels": int64 (L,)}``; labels are the token ids
    where loss is taken and -100 elsewhere, unshifted. ``ds.lengths`` holds every sample's L (as
    cached, before augmentations).
    Memory per process is the offsets array; tokens and masks stay memory-mapped.
    """

    def __init__(
        self,
        data_path: str | Path,
        tokenizer,
        max_seq_len: int,
        bad_data: str = "error",
        cache_dir: str | Path | None = None,
        augmenter=None,
        log: Callable[[str], None] = print,
    ):
        tokenizer = checked_tokenizer(tokenizer, max_seq_len)
        self.data_path = Path(data_path)
        self.max_seq_len = max_seq_len
        self.pad_token_id = tokenizer.pad_token_id
        cache_root = default_cache_root(self.data_path, cache_dir)
        self.cache = open_finished(self.data_path, tokenizer, max_seq_len, cache_root, bad_data)
        meta = self.cache.meta
        # The content this dataset holds (sha256 of the file when its cache was built): the run's
        # identity (trainer/run_identity.py) takes it from here, never from the file again.
        self.data_digest: str = meta["data_digest"]  # every cache of this key records it
        # Which samples it holds (resumable.chain_samples); None: a cache built without the record.
        self.samples_digest: str | None = meta.get("samples_digest")
        self.num_skipped: int = meta["num_skipped"]
        self.num_dropped: int = meta["num_dropped"]
        self.num_tokens: int = meta["num_tokens"]
        self.offsets = self.cache.offsets
        self.lengths = np.diff(self.offsets)
        self.augmenter = augmenter if augmenter is not None and augmenter.active else None
        # Per sample, what a system prompt may add (``ChatAugmenter.system_room``; -1: it takes none),
        # or None where no system prompt is drawn; packing plans rows with this room in them.
        self.prompt_room = (augmenter.system_room(self.tokens, self.offsets, max_seq_len)
                            if self.augmenter is not None and self.augmenter.prefixes else None)
        self.epoch = 0
        self.index_base = 0
        if self.num_skipped or self.num_dropped:
            notes = []
            if self.num_skipped:
                notes.append(f"skipped {self.num_skipped} bad lines (first: {meta['first_bad_line']})")
            if self.num_dropped:
                notes.append(
                    f"dropped {self.num_dropped} samples with no loss tokens after truncation to max_seq_len={max_seq_len}"
                )
            log(f"[data] {self.data_path}: {len(self)} samples; " + "; ".join(notes))

    @property
    def tokens(self) -> np.memmap:
        return self.cache.tokens

    @property
    def loss_mask(self) -> np.memmap:
        return self.cache.loss_mask

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


def checked_tokenizer(tokenizer, max_seq_len: int):
    """The tokenizer (loaded where a directory or ``None`` is given: ``load_tokenizer``), checked to
    be fast with a chat template, and ``max_seq_len`` checked positive."""
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    check_tokenizer(tokenizer)
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    return tokenizer


def build_cache_and_open(
    data_path: str | Path,
    tokenizer,
    max_seq_len: int,
    bad_data: str = "error",
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    augmenter=None,
    log: Callable[[str], None] = print,
) -> SFTDataset:
    """Build (or reuse, or continue) the file's token cache in this process, then open its
    ``SFTDataset``: for one process that reads a file (a script, a test). ``num_proc``: tokenizer
    processes of the build (default: one per core this process may use); the other arguments are
    ``SFTDataset``'s. Under ``torch.distributed`` the training script's data setup builds instead,
    once per node (``trainer/data_setup.build_token_caches``)."""
    tokenizer = checked_tokenizer(tokenizer, max_seq_len)
    build_or_reuse(Path(data_path), tokenizer, max_seq_len, default_cache_root(Path(data_path), cache_dir), bad_data,
                   num_proc)
    return SFTDataset(data_path, tokenizer, max_seq_len, bad_data=bad_data, cache_dir=cache_dir, augmenter=augmenter,
                      log=log)
