"""ResumableDistributedSampler: sharding, epochs, resuming (also on another world size), length grouping."""

import numpy as np
import pytest
from torch.utils.data import DataLoader

from dataset import ResumableDistributedSampler


def shards(n: int, world_size: int, **kwargs) -> list[list[int]]:
    return [list(ResumableDistributedSampler(n, world_size, rank, **kwargs)) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_are_disjoint_and_cover_the_epoch(world_size):
    n = 102  # divisible by 1, 2 and 3: no padding, so an exact partition
    parts = shards(n, world_size, seed=3)
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert [len(ResumableDistributedSampler(n, world_size, r)) for r in range(world_size)] == [len(p) for p in parts]
    uneven = shards(100, world_size, seed=3)  # padded: still covers every sample
    assert set(i for p in uneven for i in p) == set(range(100))
    assert sum(len(p) for p in uneven) == -(-100 // world_size) * world_size


def test_padding_and_drop_last_match_distributed_sampler():
    parts = shards(10, 3, seed=0)
    assert [len(p) for p in parts] == [4, 4, 4]
    order = ResumableDistributedSampler(10, 1, 0, seed=0).global_order().tolist()
    assert parts[1][-1] == order[0] and parts[2][-1] == order[1]  # padded by repeating the start
    dropped = shards(10, 3, seed=0, drop_last=True)
    assert [len(p) for p in dropped] == [3, 3, 3]
    assert len(ResumableDistributedSampler(10, 3, 0, drop_last=True)) == 3


def test_order_depends_on_seed_and_epoch_not_world_size():
    sampler = ResumableDistributedSampler(50, 1, 0, seed=7)
    epoch0 = list(sampler)
    assert list(ResumableDistributedSampler(50, 1, 0, seed=7)) == epoch0
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0 and sorted(epoch1) == sorted(epoch0)
    assert list(ResumableDistributedSampler(50, 1, 0, seed=8)) != epoch0
    two = shards(50, 2, seed=7)
    interleaved = [i for pair in zip(*two) for i in pair]
    assert interleaved == epoch0
    assert list(ResumableDistributedSampler(50, 1, 0, shuffle=False)) == list(range(50))


@pytest.mark.parametrize("world_before, world_after", [(2, 2), (1, 2), (2, 3), (4, 1)])
def test_resume_sees_exactly_the_uninterrupted_tail(world_before, world_after):
    n, k, seed, epoch = 101, 40, 5, 2
    full = ResumableDistributedSampler(n, 1, 0, seed=seed, epoch=epoch).global_order().tolist()
    first_part = shards(n, world_before, seed=seed, epoch=epoch)
    consumed = {i for part in first_part for i in part[: k // world_before]}
    assert consumed == set(full[:k])
    resumed = shards(n, world_after, seed=seed, epoch=epoch, start_index=k)
    interleaved = [part[j] for j in range(len(resumed[0])) for part in resumed]
    tail = full[k:]
    assert interleaved[: len(tail)] == tail
    # the padding repeats the start of the epoch's order, as the uninterrupted run's padding does
    assert interleaved[len(tail) :] == full[: len(interleaved) - len(tail)]


@pytest.mark.parametrize("world", [2, 3])
def test_resume_on_the_same_world_size_continues_every_rank_stream_exactly(world):
    n, k, seed = 101, 42, 9  # n not divisible by the world size: the epoch ends with padding
    uninterrupted = shards(n, world, seed=seed)
    resumed = shards(n, world, seed=seed, start_index=k)
    for rank in range(world):
        assert resumed[rank] == uninterrupted[rank][k // world :]


def test_set_start_index_and_set_epoch_interaction():
    sampler = ResumableDistributedSampler(20, 2, 1, seed=1)
    sampler.set_epoch(3)
    sampler.set_start_index(6)
    order = sampler.global_order().tolist()
    assert list(sampler) == order[6:][1::2] and len(sampler) == 7
    sampler.set_epoch(3)  # same epoch (top of the trainer's epoch loop): keeps the offset
    assert len(sampler) == 7
    sampler.set_epoch(4)  # next epoch starts from 0
    assert len(sampler) == 10 and sorted(sampler) != list(sampler)


def test_batches_match_between_one_and_two_ranks():
    n, batch = 64, 4
    one = list(DataLoader(range(n), batch_size=2 * batch, sampler=ResumableDistributedSampler(n, 1, 0, seed=2)))
    two = [
        list(DataLoader(range(n), batch_size=batch, sampler=ResumableDistributedSampler(n, 2, r, seed=2)))
        for r in range(2)
    ]
    for j, big in enumerate(one):
        assert set(big.tolist()) == set(two[0][j].tolist()) | set(two[1][j].tolist())


def batch_spread(lengths: np.ndarray, sampler, batch_size: int) -> float:
    """Mean (max - min) length within the batches of one rank."""
    order = np.fromiter(iter(sampler), dtype=np.int64)
    batches = [lengths[order[i : i + batch_size]] for i in range(0, len(order), batch_size)]
    return float(np.mean([b.max() - b.min() for b in batches]))


def test_length_grouped_batches_are_homogeneous_and_cover_the_epoch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 500, size=1000)
    world_size, batch = 2, 8
    group = batch * world_size
    grouped = [
        ResumableDistributedSampler(len(lengths), world_size, r, seed=4, lengths=lengths, group_size=group)
        for r in range(world_size)
    ]
    plain = ResumableDistributedSampler(len(lengths), world_size, 0, seed=4)
    assert batch_spread(lengths, grouped[0], batch) < 0.2 * batch_spread(lengths, plain, batch)
    assert sorted(i for s in grouped for i in s) == list(range(len(lengths)))
    order = grouped[0].global_order()
    assert sorted(order.tolist()) == list(range(len(lengths)))
    grouped[0].set_epoch(1)
    assert not np.array_equal(grouped[0].global_order(), order)
    # Still resumable by a global offset, on another world size too.
    resumed = ResumableDistributedSampler(len(lengths), 1, 0, seed=4, lengths=lengths, group_size=group, start_index=37)
    assert list(resumed) == order[37:].tolist()
    # Lengths can also be passed as the first argument.
    assert ResumableDistributedSampler(lengths, 1, 0, seed=4, group_size=group).global_order().tolist() == order.tolist()


def test_invalid_arguments():
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, 2, 2)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, 1, 0, group_size=4)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, 1, 0).set_start_index(-1)
