"""The token cache: a data file tokenized once into memory-mapped files, reused while nothing that
decides its tokens changes.

The one entry: ``build_or_reuse`` gives the directory of a file's finished cache (building it, or
continuing a killed build, when it is missing), then ``open_finished`` opens it (``TokenCache``),
building nothing: a cache that is not finished raises ``CacheNotBuilt``. The training script's data
setup builds every cache as a step of its own (``build_or_reuse_on_node``: local rank 0 of each
node builds, the node's other ranks wait); a dataset then only opens a finished cache.

Inside, named by what each part is:

* ``key``        what names a cache: the data's digest, tokenizer, template, ``max_seq_len``, versions
* ``build``      build or reuse one cache: chunks in order into a resumable build, then ``meta.json``
* ``resumable``  the build that survives being killed (committed rows, ``progress.json``, the lock)
* ``chunks``     what a worker does: a chunk of lines -> tokens and loss masks (``dataset.tokens``)
* ``workers``    the worker processes (one pipe pair each; a dead worker raises ``WorkerDied``)
* ``node``       under ``torch.distributed``: local rank 0 builds with every core of the node, the others wait
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .build import BuildInterrupted, CacheNotBuilt, build_or_reuse, check_cache, finished_cache, read_meta
from .chunks import default_num_proc
from .key import TOKENS_VERSION, default_cache_root
from .node import build_or_reuse_on_node
from .resumable import CacheWriteError
from .workers import WorkerDied


class TokenCache:
    """A finished cache opened for reading: ``meta``, ``offsets`` (int64, sample ``i`` is
    ``tokens[offsets[i]:offsets[i + 1]]``), and ``tokens`` / ``loss_mask`` memory-mapped on first
    use (not pickled: a DataLoader worker maps them again). A cache whose files disagree with each
    other (one cut short) is a ``DataError`` naming the directory to delete; ``build_or_reuse``
    builds such a cache again before it is opened."""

    def __init__(self, directory: Path):
        self.path = Path(directory)
        check_cache(self.path)
        self.meta = read_meta(self.path)
        self.token_dtype = np.dtype(self.meta["dtype"])
        self.offsets = np.load(self.path / "offsets.npy")
        self._tokens = None
        self._loss_mask = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = state["_loss_mask"] = None
        return state

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path / "tokens.bin", dtype=self.token_dtype, mode="r")
        return self._tokens

    @property
    def loss_mask(self) -> np.memmap:
        if self._loss_mask is None:
            self._loss_mask = np.memmap(self.path / "loss_mask.bin", dtype=np.uint8, mode="r")
        return self._loss_mask


def open_finished(path: Path, tokenizer, max_seq_len: int, cache_root: Path, bad_data: str = "error") -> TokenCache:
    """The finished cache of this (data, tokenizer, ``max_seq_len``), opened; it builds nothing and
    runs no collective (``build.finished_cache``: ``CacheNotBuilt`` where none is finished)."""
    return TokenCache(finished_cache(path, tokenizer, max_seq_len, cache_root, bad_data))


__all__ = ["BuildInterrupted", "CacheNotBuilt", "CacheWriteError", "TOKENS_VERSION", "TokenCache",
           "WorkerDied", "build_or_reuse", "build_or_reuse_on_node", "default_cache_root", "default_num_proc",
           "open_finished"]
