"""all_reduce by recursive halving and doubling: the ring's bytes in log2 W steps (Rabenseifner).

    pytest tests/test_collectives.py -k halving    # equal to its own order, one process

Halving, a reduce_scatter in log2 W steps: in step k each rank pairs with the rank whose
number differs in bit k (distance 1, 2, 4, ...), keeps one half of the range it holds, sends
the other half to its partner and adds the partner's copy of its own half. The range halves
every step; after log2 W steps each rank holds 1/W of the tensor, summed over all ranks.
Doubling, an all_gather, runs the steps backwards: each rank swaps its range with the
partner of that step, and the range doubles back to the whole tensor. Each rank sends
2(W-1)/W of the tensor, as in the ring, in 2 log2 W steps instead of 2(W-1).
W not a power of two: the first 2e ranks (e = W - the largest power of two below W) pair
up first; the even one hands its tensor to the odd one, which goes on in its place, and
gets the result back at the end: two steps and one tensor more for those ranks.
The order: partners at distance 1 first, so every element is summed as the tree sums it
(tree.py) over the ranks that go on: (x0 + x1) + (x2 + x3) at W = 4, (x0 + x1) + x2 at
W = 3, and at W = 8 the same bits as tree.py. Not gloo's order for W >= 3: the tests prove
it equal to the same additions in one process, and measure how far it lands from gloo's.
"""

import torch

from ..launch.groups import is_member
from .checks import check_same_shape, flat_memory
from .ops import ReduceOp, check_op, combine, finish
from .p2p import exchange, rank_and_size
from .work import launch


def halving_doubling_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `tensor` over the ranks, in place, by recursive halving, then doubling.

    Collective: call on every rank. all_reduce()'s signature."""
    if not is_member(group):
        return None
    flat = flat_memory(tensor, "halving_doubling_all_reduce")
    check_op(op, "halving_doubling_all_reduce", tensor.dtype)
    return launch(_halving_doubling, (tensor, flat, op, group), [tensor], async_op)


def _halving_doubling(tensor, flat, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(tensor, group, "halving_doubling_all_reduce")
    power = 1 << (size.bit_length() - 1)  # the largest power of two <= W
    extra = size - power
    incoming = torch.empty_like(flat)
    if rank < 2 * extra and rank % 2 == 0:  # I hand my tensor over and wait for the sum
        exchange(group, sends=[(flat, rank + 1)])
        exchange(group, receives=[(flat, rank + 1)])
        finish(op, flat, size)
        return
    if rank < 2 * extra:  # I go on for two: mine + my even neighbour's
        exchange(group, receives=[(incoming, rank - 1)])
        combine(op, flat, incoming)
    me = rank // 2 if rank < 2 * extra else rank - extra  # my number among the `power`
    ranges = halve(flat, op, group, me, power, extra, incoming)
    double(flat, group, me, power, extra, ranges)
    if rank < 2 * extra:
        exchange(group, sends=[(flat, rank - 1)])
    finish(op, flat, size)


def _group_rank(me, extra):
    """The group rank of the `me`-th rank that goes on."""
    return 2 * me + 1 if me < extra else me + extra


def halve(flat, op, group, me, power, extra, incoming):
    """The reduce_scatter: returns the ranges held before each step (the last: my own)."""
    low, high = 0, flat.numel()
    ranges = [(low, high)]
    distance = 1
    while distance < power:
        middle = low + (high - low) // 2
        partner = _group_rank(me ^ distance, extra)
        # Partners hold the same range (their numbers agree below this bit); the one with
        # the bit clear keeps the lower half.
        if me & distance == 0:
            keep, give = (low, middle), (middle, high)
        else:
            keep, give = (middle, high), (low, middle)
        arrived = incoming[:keep[1] - keep[0]]
        exchange(group, sends=[(flat[give[0]:give[1]], partner)],
                 receives=[(arrived, partner)])
        combine(op, flat[keep[0]:keep[1]], arrived)
        low, high = keep
        ranges.append(keep)
        distance *= 2
    return ranges


def double(flat, group, me, power, extra, ranges):
    """The all_gather: halve()'s steps backwards, each swapping my range for my partner's."""
    distance = power
    for step in range(len(ranges) - 1, 0, -1):
        distance //= 2
        partner = _group_rank(me ^ distance, extra)
        (low, high), (whole_low, whole_high) = ranges[step], ranges[step - 1]
        # The partner holds the other half of the range we both held before this step.
        theirs = (whole_low, low) if low > whole_low else (high, whole_high)
        exchange(group, sends=[(flat[low:high], partner)],
                 receives=[(flat[theirs[0]:theirs[1]], partner)])
