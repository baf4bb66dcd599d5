"""A distributed sampler whose global order ignores world size, so training can resume mid-epoch.

The global order of an epoch depends only on (seed, epoch) (and the lengths in length-grouped
mode). With ``k`` samples already consumed globally, the remaining order ``order[k:]`` is padded
by repeating the epoch order's start to a multiple of ``num_replicas`` (or truncated with ``drop_last``) and
rank ``r`` takes ``remaining[r::num_replicas]``. Hence the union of all ranks' batch ``j`` (batch
size ``B`` each) is ``remaining[j*B*W:(j+1)*B*W]`` for any world size ``W``: a resumed run sees
exactly what an uninterrupted run would have seen next, even on a different number of GPUs.
The padding repeats are yielded as ``FillerIndex``: their rows count for nothing in training
(``epoch_padding``), so an epoch's last step is also the same on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from .epoch_padding import FillerIndex


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler`` semantics plus a global start offset and optional length grouping.

    Args:
        dataset_len: number of samples, or a sequence of per-sample lengths (then also ``lengths``).
        num_replicas, rank: default to the ``torch.distributed`` world (or 1 and 0).
        shuffle, seed, drop_last: as in ``DistributedSampler``; the permutation comes from a
            ``torch.Generator`` seeded with ``seed + epoch``.
        start_index: samples of the current epoch already consumed globally (see ``set_start_index``).
        lengths, group_size: length-grouped mode. The shuffled order is cut into megabatches of
            ``group_size * megabatch_groups`` samples, each sorted by length and cut into groups of
            ``group_size``; the groups are shuffled (an incomplete last group goes last). The
            trainer passes ``group_size = batch_size * world_size * accumulation_steps`` (one
            optimizer step's global batch): the interleaved per-rank shards of one group form every
            rank's micro-batches, all of similar length, for any split of that global batch.
        epoch: the starting epoch.
        mixture: optional ``dataset.mixture.EpochMixture``: each epoch's order is a shuffle of its
            ``members(epoch)`` (sources repeated or subsampled by their weights) instead of
            ``0 .. dataset_len - 1``; ``dataset_len`` must equal its length. One source gives the
            plain order.

    Pinned grouping: ``pin_epoch_grouping(e, g)`` makes epoch ``e`` use group size ``g`` (``None``:
    no grouping) whatever ``group_size`` is. A run resumed with another global batch or
    ``--group_by_length`` finishes the interrupted epoch in the order its checkpoint's run used, so
    the consumed prefix ``order[:start_index]`` and the rest still partition the epoch.

    Epoch and start index: ``set_epoch(e)`` with a new epoch resets the start index to 0, with
    the current epoch it keeps it. So a resuming trainer may call ``set_epoch(e)`` then
    ``set_start_index(k)``, and still call ``set_epoch(e)`` again at the top of its epoch loop.
    """

    def __init__(
        self,
        dataset_len: int | Sequence[int] | np.ndarray,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        start_index: int = 0,
        lengths: Sequence[int] | np.ndarray | None = None,
        group_size: int | None = None,
        megabatch_groups: int = 50,
        epoch: int = 0,
        mixture=None,
    ):
        if not isinstance(dataset_len, (int, np.integer)):
            lengths = dataset_len if lengths is None else lengths
            dataset_len = len(dataset_len)
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
            rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        if group_size is not None and lengths is None:
            raise ValueError("group_size needs lengths")
        if lengths is not None and len(lengths) != dataset_len:
            raise ValueError(f"got {len(lengths)} lengths for {dataset_len} samples")
        if mixture is not None and len(mixture) != dataset_len:
            raise ValueError(f"the mixture's epoch has {len(mixture)} samples, the dataset {dataset_len}")
        self.dataset_len = int(dataset_len)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self.group_size = group_size
        self.megabatch_groups = megabatch_groups
        self.epoch = epoch
        self.mixture = mixture
        self.pinned_grouping: dict[int, int | None] = {}
        self.start_index = 0
        self.set_start_index(start_index)

    def pin_epoch_grouping(self, epoch: int, group_size: int | None) -> None:
        """Order epoch ``epoch`` with ``group_size`` (``None``: no length grouping), not the default one."""
        if group_size is not None and self.lengths is None:
            raise ValueError("group_size needs lengths")
        self.pinned_grouping = {epoch: group_size}

    def epoch_group_size(self, epoch: int | None = None) -> int | None:
        """The group size that orders epoch ``epoch`` (default: the current one)."""
        return self.pinned_grouping.get(self.epoch if epoch is None else epoch, self.group_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a different epoch than the current one restarts it at 0."""
        if epoch != self.epoch:
            self.start_index = 0
        self.epoch = epoch

    def set_start_index(self, start_index: int) -> None:
        """Skip the first ``start_index`` samples of the current epoch's global order."""
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        self.start_index = int(start_index)

    def global_order(self) -> np.ndarray:
        """The whole epoch's order of sample indices, identical on every rank and world size."""
        members = self.mixture.members(self.epoch) if self.mixture is not None else None
        if not self.shuffle:
            return members if members is not None else np.arange(self.dataset_len, dtype=np.int64)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_len, generator=generator).numpy()
        if members is not None:
            order = members[order]
        group_size = self.epoch_group_size()
        if group_size is None:
            return order
        return self._group_by_length(order, generator, group_size)

    def _group_by_length(self, order: np.ndarray, generator: torch.Generator, group_size: int) -> np.ndarray:
        megabatch = group_size * self.megabatch_groups
        groups = []
        for start in range(0, len(order), megabatch):
            chunk = order[start : start + megabatch]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            groups.extend(chunk[i : i + group_size] for i in range(0, len(chunk), group_size))
        tail = [groups.pop()] if groups and len(groups[-1]) < group_size else []
        permutation = torch.randperm(len(groups), generator=generator).tolist()
        return np.concatenate([groups[i] for i in permutation] + tail).astype(np.int64)

    def remaining(self) -> np.ndarray:
        """``order[start_index:]`` padded with ``order[0], order[1], ...`` (or truncated) to a multiple of ``num_replicas``."""
        order = self.global_order()
        remaining = order[self.start_index :]
        if self.drop_last:
            return remaining[: len(remaining) // self.num_replicas * self.num_replicas]
        padding = -len(remaining) % self.num_replicas
        if padding and len(order):
            # Pad from the start of the whole epoch's order (not of the remainder): a run resumed
            # on the same world size then pads exactly like the uninterrupted run did.
            repeats = -(-padding // len(order))
            remaining = np.concatenate([remaining, np.tile(order, repeats)[:padding]])
        return remaining

    def __iter__(self) -> Iterator[int]:
        """This rank's share of ``remaining()``; the padding repeats come as ``FillerIndex`` (see epoch_padding.py)."""
        remaining = self.remaining().tolist()
        real = max(self.dataset_len - self.start_index, 0)  # the positions from here on only pad
        positions = range(self.rank, len(remaining), self.num_replicas)
        return iter([remaining[p] if p < real else FillerIndex(remaining[p]) for p in positions])

    def __len__(self) -> int:
        return samples_per_replica(max(self.dataset_len - self.start_index, 0), self.num_replicas, self.drop_last)


def samples_per_replica(samples: int, num_replicas: int, drop_last: bool = False) -> int:
    """Each rank's share of `samples` samples: padded up to a multiple of `num_replicas`, or truncated
    down with `drop_last`."""
    return samples // num_replicas if drop_last else -(-samples // num_replicas)
