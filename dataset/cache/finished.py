"""A finished token cache: its record (``meta.json``), the one check that its files agree, and
``TokenCache``, the cache opened for reading (found by ``build.open_finished``).

The check (``read_checked``) reads the sizes of the files, the header of ``offsets.npy`` and its
two ends, and the token ids, block by block, for one outside the vocabulary. It runs once per
open, in ``TokenCache``: a damaged cache is a one-line ``DataError`` naming the directory to
delete. The build step runs the same check before it reuses
a cache and builds a damaged one again (``build.build_or_reuse``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..formats import DataError

TOKENS_BLOCK = 1 << 24  # token ids read at a time by the vocabulary check


def read_meta(cache: Path) -> dict:
    return json.loads((cache / "meta.json").read_text(encoding="utf-8"))


def read_checked(cache: Path) -> tuple[dict | None, str | None]:
    """``(meta, None)``: the record of the finished cache ``cache`` when its files agree with each
    other; ``(meta or None, problem)``: what is wrong with them, one phrase. They agree when
    ``meta.json`` is readable, ``offsets.npy`` is whole with ``num_samples + 1`` entries from 0 to
    ``num_tokens``, ``tokens.bin`` and ``loss_mask.bin`` are ``num_tokens`` entries long, and every
    token id is below the recorded ``vocab_size``. A file cut short (a copy stopped halfway, a disk
    that filled outside the build, a lost write) or a token id that damage put past the vocabulary
    (flipped bits) is found here, not as a numpy error or an embedding's index error at a step."""
    try:
        meta = read_meta(cache)
        samples, tokens, itemsize = meta["num_samples"], meta["num_tokens"], np.dtype(meta["dtype"]).itemsize
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"meta.json is not a cache record ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    try:
        with open(cache / "offsets.npy", "rb") as f:
            np.lib.format.read_magic(f)
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            data_start = f.tell()
    except (OSError, ValueError) as exc:
        return meta, f"offsets.npy cannot be read ({exc.strerror if isinstance(exc, OSError) else exc})"
    if shape != (samples + 1,) or dtype != np.int64:
        return meta, f"offsets.npy holds {dtype} {shape}, int64 ({samples + 1},) expected"
    expected = {"offsets.npy": data_start + (samples + 1) * 8, "tokens.bin": tokens * itemsize, "loss_mask.bin": tokens}
    for name, size in expected.items():
        actual = (cache / name).stat().st_size if (cache / name).is_file() else None
        if actual != size:
            return meta, f"{name} has {'no file' if actual is None else f'{actual:,} bytes'}, {size:,} expected"
    offsets = np.memmap(cache / "offsets.npy", dtype=np.int64, mode="r", offset=data_start)
    if offsets[0] != 0 or offsets[-1] != tokens:
        return meta, f"offsets.npy runs from {offsets[0]:,} to {offsets[-1]:,}, from 0 to {tokens:,} expected"
    return meta, token_outside_vocabulary(cache / "tokens.bin", np.dtype(meta["dtype"]), meta.get("vocab_size"))


def token_outside_vocabulary(path: Path, dtype: np.dtype, vocab_size) -> str | None:
    """Where ``path`` (token ids of ``dtype``) holds an id not below ``vocab_size``, one phrase
    naming the first; None when every id is in the vocabulary or no vocabulary is recorded. Read in
    blocks of ``TOKENS_BLOCK`` ids, so memory stays flat."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return None
    ids = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
    for start in range(0, len(ids), TOKENS_BLOCK):
        block = ids[start:start + TOKENS_BLOCK]
        outside = np.flatnonzero(block >= vocab_size)
        if len(outside):
            at = start + int(outside[0])
            return f"tokens.bin holds token id {int(ids[at]):,} at entry {at:,}, outside the vocabulary of {vocab_size:,}"
    return None


class TokenCache:
    """A finished cache opened for reading: ``meta``, ``offsets`` (int64, sample ``i`` is
    ``tokens[offsets[i]:offsets[i + 1]]``), and ``tokens`` / ``loss_mask`` memory-mapped on first
    use (not pickled: a DataLoader worker maps them again). A cache whose files disagree with each
    other (one cut short) is a ``DataError`` naming the directory to delete; ``build_or_reuse``
    builds such a cache again before it is opened."""

    def __init__(self, directory: Path):
        self.path = Path(directory)
        meta, problem = read_checked(self.path)
        if problem is not None:
            raise DataError(f"the token cache {self.path} is damaged: {problem}; delete {self.path} and run again to "
                            "build it anew")
        self.meta = meta
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
