"""One order for a sum, whatever the mesh: a binary tree over a fixed number of leaves.

    pytest tests/test_invariant.py -k tree     # the same bits for every way of cutting the leaves

Floating-point addition is not associative: (a + b) + c and a + (b + c) round differently. A
sum that a mesh splits (over dp ranks, over tp ranks, over microbatches) is added in an order
the mesh chooses, so two meshes give two sets of bits. The way out is to fix the terms and
their order first, then let the mesh decide only who adds which part of it.
The terms, "leaves", are a fixed number L (a power of two) of pieces of the work: the virtual
shards of the batch, the chunks of a split dimension. The order is the pairwise tree, L = 8:

    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))

A group of W ranks (W a power of two that divides L) holds the leaves in runs: rank r the
r-th run of L / W. Each run is a whole subtree, so a rank folds its own leaves (fold), then
the ranks add their subtrees pairwise, partners at distance 1, 2, 4, ...: chapter 0's
halving_doubling_all_reduce adds in exactly that order, neighbours first (its docstring),
and a + b is b + a bit for bit, so both partners hold the same sum. One rank holding all L
leaves folds the whole tree itself: the same additions, the same bits, at every W.
In the order below: fold, Folder (the same fold for leaves that arrive one by one: a
microbatch's gradient after each backward), tree_sum (fold, then over the group).
"""

import torch.distributed as dist

from ..collectives import halving_doubling_all_reduce
from ..launch.usage_error import UsageError


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def fold(parts):
    """The pairwise tree's sum of `parts` (a power of two of them), neighbours first."""
    if not is_power_of_two(len(parts)):
        raise UsageError(f"{len(parts)} leaves do not make a pairwise tree",
                         hint="the leaves of every sum are a power of two")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


class Folder:
    """The pairwise tree, built as leaves arrive: leaf k joins its left neighbour's subtree as
    soon as both halves of a pair are there, as a binary counter carries. At most log2 L
    partial sums are kept at a time, never the L leaves themselves."""

    def __init__(self):
        self.stack = []  # (the leaves under it, a partial sum), the larger subtrees first

    def add(self, leaf):
        size = 1
        while self.stack and self.stack[-1][0] == size:
            _, left = self.stack.pop()
            leaf = left + leaf  # the earlier subtree on the left, as fold() adds
            size *= 2
        self.stack.append((size, leaf))

    def total(self):
        """The sum of the leaves so far (a power of two of them); the folder starts empty."""
        if len(self.stack) != 1:
            counted = sum(size for size, _ in self.stack)
            raise UsageError(f"{counted} leaves arrived, not a power of two",
                             hint="every rank must run all of its shards (microbatches)")
        (_, leaf), self.stack = self.stack[0], []
        return leaf


def tree_sum(parts, group=None):
    """Collective over `group` (None: this rank alone): the pairwise tree's sum of every
    rank's parts, rank r holding the r-th run of leaves. The same bits on every rank.
    group may be a list of groups, the innermost first: the ranks of a grid numbered row by
    row (HSDP's replicas of shard groups), whose tree is one group's tree, then the next's."""
    total = fold(list(parts))
    for one in group if isinstance(group, (list, tuple)) else [group]:
        total = _over(total, one)
    return total


def _over(total, group):
    if group is not None and not is_power_of_two(dist.get_world_size(group)):
        raise UsageError(f"a tree over {dist.get_world_size(group)} ranks",
                         hint="the invariant mode's dimensions are powers of two",
                         same_on_every_rank=True)
    if group is not None and dist.get_world_size(group) > 1:
        total = total.clone()  # summed in place: never the caller's leaf
        if dist.get_world_size(group) == 2:
            # One addition per element, and a + b is b + a: any order is the tree's, and
            # gloo's own all_reduce (in C++) gives its bits sooner. From 4 ranks its ring
            # adds in an order of its own.
            dist.all_reduce(total, group=group)
        else:
            halving_doubling_all_reduce(total, group=group)
    return total
