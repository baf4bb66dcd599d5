"""trainer/loop/step_count.py: a run's optimizer steps, counted as the sampler and a DataLoader deal them."""

import itertools
import math

import torch.utils.data

from dataset.sampler import ResumableDistributedSampler
from trainer.loop.step_count import micro_batches, run_steps, steps_over


def dealt_micro_batches(samples: int, processes: int, batch_size: int, start: int) -> int:
    """Rank 0's micro-batches of an epoch from sample `start`, as its DataLoader yields them."""
    sampler = ResumableDistributedSampler(samples, num_replicas=processes, rank=0, seed=3)
    sampler.set_start_index(start)
    return len(list(torch.utils.data.DataLoader(range(samples), batch_size=batch_size, sampler=sampler)))


def test_the_counts_are_the_micro_batches_a_process_is_dealt_and_their_steps():
    for samples, processes, batch, accumulation, start in itertools.product(
            (1, 7, 50), (1, 2, 3), (1, 4), (1, 3), (0, 5, 60)):
        dealt = dealt_micro_batches(samples, processes, batch, start)
        left = max(samples - start, 0)
        assert micro_batches(left, processes, batch) == dealt
        assert steps_over(left, processes, batch, accumulation) == math.ceil(dealt / accumulation)


def test_the_run_counts_what_is_done_this_epochs_rest_and_every_later_epoch_capped_by_max_steps():
    # 1,000 samples over 2 processes, batch 4, 3 micro-batches a step: 125 micro-batches, 42 steps an epoch
    assert run_steps(1000, 2, 4, 3, epochs=3, max_steps=0, step=0, epoch=0, samples_in_epoch=0) == 126
    # in epoch 1 after 600 samples (300 a process: 75 micro-batches, 25 steps): 17 steps left in it
    assert run_steps(1000, 2, 4, 3, epochs=3, max_steps=0, step=67, epoch=1, samples_in_epoch=600) == 67 + 17 + 42
    assert run_steps(1000, 2, 4, 3, epochs=3, max_steps=50, step=0, epoch=0, samples_in_epoch=0) == 50
    assert run_steps(1000, 2, 4, 3, epochs=3, max_steps=0, step=126, epoch=3, samples_in_epoch=0) == 126
    assert run_steps(1000, 1, 1, 1, epochs=10**10, max_steps=0, step=0, epoch=0, samples_in_epoch=0) == 10**13
