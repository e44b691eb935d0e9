"""ShardSampler: which examples each rank trains on (what DistributedSampler does), from scratch.

    python -c "from minddp import *; print(list(ShardSampler(range(5), num_replicas=2, rank=0)))"

Data parallelism needs every rank to see a *different* slice of each epoch, and every
rank to take the *same number* of steps (each step ends in a collective that all ranks
must join). The recipe, identical to torch.utils.data.distributed.DistributedSampler:

    1. order    all indices, shuffled with a generator seeded by seed + epoch; every rank
                computes the same permutation without talking to the others
    2. even up  pad by repeating from the start (or, with drop_last, cut the tail) so the
                length divides by num_replicas
    3. deal     rank r takes positions r, r + num_replicas, r + 2*num_replicas, ...
"""

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..launch.usage_error import UsageError


class ShardSampler(Sampler):
    """This rank's share of every epoch: DistributedSampler's indices, written out."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        """DistributedSampler's arguments; num_replicas and rank default to the process group's."""
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval"
                             f" [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        n = len(dataset)
        # Every rank must get the same count, or one rank would wait in a collective forever.
        # drop_last rounds down (the tail is never seen this epoch), otherwise round up and pad.
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        """Call at the start of each epoch: without it every epoch repeats epoch 0's order."""
        self.epoch = epoch

    def __iter__(self):
        n = len(self.dataset)
        if self.shuffle:
            # The same seed on every rank gives the same permutation on every rank: that is
            # what keeps the shards disjoint with no communication at all.
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        # Pad by cycling through the order again (a few examples are seen twice), or cut
        # the tail; either way the length is now total_size.
        order = [order[i % n] for i in range(self.total_size)]
        return iter(order[self.rank::self.num_replicas])

    def __len__(self):
        return self.num_samples


def check_batches(loader, world_size):
    """Fail clearly when this rank would get zero batches (and so train on nothing)."""
    if len(loader) == 0:
        raise UsageError(
            f"each rank gets {len(loader.sampler)} example(s) of {len(loader.dataset)}"
            f" at world size "
            f"{world_size}, fewer than one batch of {loader.batch_size} with drop_last: zero steps",
            hint="fewer processes, or enlarge the data with --factor"
                 " (e.g. --factor 4 for up to 8 ranks)",
            same_on_every_rank=True)
