"""How many optimizer steps a run takes, counted from a position in its epochs: the loop's total at
every start (`loop.count_total_steps`), and the total a checkpoint's own flags give where it
records no schedule (`lr_schedule.unrecorded_schedule`), which may be of another world size.

An epoch is the sampler's whole dataset (the same length every epoch); each process takes every
world-th sample of what is left of it, padded to a multiple of the world size
(`ResumableDistributedSampler`); its micro-batches of --batch_size samples, the last one shorter;
--accumulation_steps of them an optimizer step, the epoch's last step the rest."""

from __future__ import annotations

import math

from dataset.sampler import samples_per_replica


def micro_batches(samples: int, processes: int, batch_size: int) -> int:
    """Each process's micro-batches over `samples` samples of an epoch."""
    return math.ceil(samples_per_replica(samples, processes) / batch_size)


def steps_over(samples: int, processes: int, batch_size: int, accumulation: int) -> int:
    """Optimizer steps over `samples` samples of an epoch."""
    return math.ceil(micro_batches(samples, processes, batch_size) / accumulation)


def run_steps(dataset_len: int, processes: int, batch_size: int, accumulation: int, epochs: int,
              max_steps: int, step: int, epoch: int, samples_in_epoch: int) -> int:
    """The run's total: `step` done, the steps left in epoch `epoch` from its sample `samples_in_epoch`
    and in every later epoch (counted once and multiplied: a count per epoch would take hours at
    --epochs 10000000000), capped by `max_steps` (0: none)."""
    total = step
    if epoch < epochs:
        total += steps_over(max(dataset_len - samples_in_epoch, 0), processes, batch_size, accumulation)
        total += (epochs - epoch - 1) * steps_over(dataset_len, processes, batch_size, accumulation)
    return min(total, max_steps) if max_steps else total
