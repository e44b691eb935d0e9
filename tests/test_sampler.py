"""ShardSampler against torch's DistributedSampler, index for index.

    pytest tests/test_sampler.py
"""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers import share_spawn, shared_results
from minddp import ShardSampler, UsageError, check_batches


@pytest.mark.parametrize("shuffle,drop_last", list(itertools.product([True, False], [True, False])))
def test_same_indices_as_distributed_sampler(shuffle, drop_last):
    checked = 0
    for size, world_size, seed in itertools.product(range(0, 14), range(1, 6), [0, 7, 123]):
        data = range(size)
        for rank in range(world_size):
            ours = ShardSampler(data, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            ref = DistributedSampler(data, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            for epoch in range(3):
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
                assert list(ours) == list(ref), (size, world_size, rank, seed, epoch)
                assert len(ours) == len(ref)
                checked += 1
    assert checked == 14 * 15 * 3 * 3  # sizes x (1+..+5 ranks) x seeds x epochs


def test_shards_cover_the_epoch_and_reshuffle():
    data = range(10)
    shards = [list(ShardSampler(data, 3, r, seed=1)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]
    # 12 places for 10 examples: the permutation's first two are dealt again at the end.
    padding = [shards[0][0], shards[1][0]]
    assert sorted(sum(shards, [])) == sorted(list(data) + padding)
    epoch0 = list(ShardSampler(data, 2, 0))
    moved = ShardSampler(data, 2, 0)
    moved.set_epoch(1)
    assert list(moved) != epoch0  # set_epoch changes the order
    assert list(ShardSampler(data, 2, 0)) == epoch0  # and the same epoch repeats it


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="Invalid rank 2"):
        ShardSampler(range(5), num_replicas=2, rank=2)


def _defaults_from_group(rank, world_size):
    s = ShardSampler(range(7))  # no num_replicas / rank: asks the process group
    return s.num_replicas, s.rank, list(s)


def test_defaults_come_from_the_process_group():
    results = shared_results(_defaults_from_group, 2)
    for rank, (num_replicas, r, indices) in enumerate(results):
        assert (num_replicas, r) == (2, rank)
        assert indices == list(DistributedSampler(range(7), 2, rank))


def test_zero_batches_is_a_usage_error():
    data = torch.utils.data.TensorDataset(torch.zeros(5, 2))
    loader = DataLoader(data, batch_size=2, drop_last=True, sampler=ShardSampler(data, 6, 0))
    with pytest.raises(UsageError, match="zero steps") as info:
        check_batches(loader, 6)
    assert "--factor" in info.value.hint
    fine = DataLoader(data, batch_size=2, drop_last=True, sampler=ShardSampler(data, 2, 0))
    check_batches(fine, 2)  # 3 examples: one batch of 2


share_spawn(_defaults_from_group, [2])  # in the spawn the other modules share
