"""The sampler's check: ShardSampler against DistributedSampler, every index, every epoch.

    minddp grade exercises/sampler.py        # grade.py runs CHECKS["sampler"] on every rank

Per shuffle and drop_last: 6 dataset sizes (some every rank count divides, some none) x 2
seeds x 3 epochs, each rank's indices; then torch's global random state, which a sampler
must leave as it was. Each check runs on every rank, gathers what every rank saw, and
returns the same results on each: [{"check", "passed", "where", "diagnosis"}], the first
difference and why.
"""

import torch
from torch.utils.data.distributed import DistributedSampler

from ..shared.training import _everyone, _ranks, _result


SIZES = (1, 5, 7, 10, 16, 17)  # dataset lengths: some every rank count divides, some none


def sampler(student, rank, world_size):
    """ShardSampler against DistributedSampler: every index, every epoch, every setting."""
    results = []
    for shuffle in (True, False):
        for drop_last in (False, True):
            seen = {}
            for n in SIZES:
                for seed in (0, 3):
                    for who, cls in (("yours", student.ShardSampler),
                                     ("stock", DistributedSampler)):
                        s = cls(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                seed=seed, drop_last=drop_last)
                        for epoch in range(3):
                            s.set_epoch(epoch)
                            seen[who, n, seed, epoch] = list(s)
            everyone = _everyone(seen)
            label = f"{_ranks(world_size)}, shuffle={shuffle}, drop_last={drop_last}"
            results.append(_result(label, *_sampler_verdict(everyone, world_size, shuffle)))
    # Stock draws from a generator of its own: the training's random numbers (dropout,
    # augmentation, initialisation) are the same whether or not a sampler ran.
    before = torch.get_rng_state()
    s = student.ShardSampler(range(10), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    s.set_epoch(1)
    list(s)
    touched = not torch.equal(before, torch.get_rng_state())
    results.append(_result(f"{_ranks(world_size)}, torch's global random state", not touched,
                           "after set_epoch(1) and one epoch's indices" if touched else "",
                           "the sampler moved or reset torch's global random state"
                           " (torch.manual_seed or a draw without a generator): every rank's"
                           " dropout and initialisation change with it; shuffle with a"
                           " torch.Generator of its own, seeded seed + epoch" if touched else ""))
    return results


def _sampler_verdict(everyone, world_size, shuffle):
    for n in SIZES:
        for seed in (0, 3):
            for epoch in range(3):
                for rank in range(world_size):
                    yours = everyone[rank]["yours", n, seed, epoch]
                    stock = everyone[rank]["stock", n, seed, epoch]
                    if yours == stock:
                        continue
                    at = next((i for i, (a, b) in enumerate(zip(yours, stock)) if a != b),
                              min(len(yours), len(stock)))
                    where = (f"{n} examples, seed {seed}, epoch {epoch}, rank {rank}, position"
                             f" {at}: yours {yours[at:at + 3]}..., stock's {stock[at:at + 3]}...")
                    return False, where, _sampler_why(everyone, world_size, n, seed, epoch, rank,
                                                      shuffle)
    return True, "", ""


def _sampler_why(everyone, world_size, n, seed, epoch, rank, shuffle):
    def all_ranks(who, e):
        return [everyone[r][who, n, seed, e] for r in range(world_size)]
    yours, stock = all_ranks("yours", epoch), all_ranks("stock", epoch)
    if epoch and yours == all_ranks("yours", 0) and stock != all_ranks("stock", 0):
        return ("the same order every epoch: seed the generator with seed + epoch (what"
                " set_epoch is for)")
    if len(yours[rank]) != len(stock[rank]):
        return (f"rank {rank} gets {len(yours[rank])} indices, stock's {len(stock[rank])}:"
                f" every rank must get as many (pad by cycling from the start, or with"
                f" drop_last cut the tail), or a rank waits in a collective forever")
    order = ("shuffled by torch.randperm(n) with a generator seeded seed + epoch, before the"
             " padding and the dealing" if shuffle else "shuffle=False keeps 0 .. n-1 in order")
    if all(sorted(a) == sorted(b) for a, b in zip(yours, stock)):
        return f"each rank gets stock's indices, in another order: {order}"
    stocks_order = [stock[i % world_size][i // world_size] for i in range(sum(map(len, stock)))]
    if sum(yours, []) == stocks_order:
        return ("the same indices, dealt to other ranks: stock deals positions rank,"
                " rank + num_replicas, rank + 2 * num_replicas, ... (not a block per rank)")
    if len({len(y) for y in yours}) == 1:  # dealt as stock deals: the order it was dealt from
        dealt = [yours[i % world_size][i // world_size] for i in range(sum(map(len, yours)))]
        if dealt[:n] == stocks_order[:n]:
            return ("the order is stock's, what pads it is not: stock pads to total_size by"
                    " cycling from the start of the order (position i takes order[i % n])")
    if set(sum(yours, [])) == set(stocks_order):
        return f"the same indices over all ranks, in another order: {order}"
    return ("other indices than stock's: the order (torch.randperm(n) with a generator seeded"
            " seed + epoch; 0 .. n-1 without shuffle) or what pads it")
