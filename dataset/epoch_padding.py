"""The rows that only pad the end of an epoch to a multiple of the world size: they count for nothing.

When an epoch's samples do not divide by the number of processes, `ResumableDistributedSampler`
(like torch's `DistributedSampler`) repeats samples from the start of the epoch's order so that
every rank gets as many samples, and so runs the same steps and collectives as the others. Trained
like real samples, those repeats made the epoch's last step differ from the same step on one
process: 29 samples on 2 ranks x 4 trained one sample twice, and the weights differed by a whole
Adam step's size (~1.5e-3 at lr 3e-3), far beyond rounding.

So the sampler yields those repeats as `FillerIndex` (an int that equals the plain index),
`MarkFillers` flags the item served for one, and `SFTCollator` gives a flagged row no labels and
an attention mask of 0: the row is still computed (same shapes on every rank), but it adds no loss
token, no real token and no row to the step's counts and no term to the MoE balance loss, so its
gradient is exactly 0.
"""

from __future__ import annotations

from torch.utils.data import Dataset


class FillerIndex(int):
    """A sample index repeated only to pad the epoch to a multiple of the world size."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"FillerIndex({int(self)})"


class MarkFillers(Dataset):
    """`dataset` as the DataLoader sees it: the item of a `FillerIndex` carries `filler=True`."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = self.dataset[index]
        if isinstance(index, FillerIndex):
            item = {**item, "filler": True}
        return item
