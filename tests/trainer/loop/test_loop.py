"""trainer/loop/loop.py: the run's total optimizer steps, counted before the first step."""

from types import SimpleNamespace

import pytest

from dataset.sampler import ResumableDistributedSampler
from trainer.loop.loop import count_total_steps


def run_at(epoch: int, samples_in_epoch: int, step: int, epochs: int, max_steps: int = 0):
    """A run of 1,000 samples over 2 ranks, batch 4, 3 micro-batches per step: 42 steps a full epoch
    (500 samples per rank, 125 micro-batches), resumed at `epoch`, `samples_in_epoch`, `step`."""
    sampler = ResumableDistributedSampler(1000, num_replicas=2, rank=1, seed=7)
    args = SimpleNamespace(epochs=epochs, max_steps=max_steps, batch_size=4, accumulation_steps=3)
    state = SimpleNamespace(epoch=epoch, samples_in_epoch=samples_in_epoch, step=step)
    return SimpleNamespace(args=args, state=state, data=SimpleNamespace(sampler=sampler))


@pytest.mark.parametrize("epochs", [1, 3, 10**12])
def test_the_total_counts_the_rest_of_this_epoch_and_every_later_one(epochs):
    assert count_total_steps(run_at(0, 0, 0, epochs)) == 42 * epochs
    # resumed in epoch 1 after 600 of its samples (300 a rank: 75 micro-batches, 25 steps): 17 steps left in it
    assert count_total_steps(run_at(1, 600, 67, max(epochs, 2))) == 67 + 17 + 42 * (max(epochs, 2) - 2)
    assert count_total_steps(run_at(0, 0, 0, epochs, max_steps=50)) == min(42 * epochs, 50)
