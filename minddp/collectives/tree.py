"""all_reduce down a tree: sum up a binomial tree onto rank 0, then broadcast back down it.

    pytest tests/test_collectives.py -k tree     # equal to its own order, one process

In round k (k = 0, 1, ...) a rank whose number ends in 1 followed by k zeros sends what it
has summed so far to the rank 2^k below it and is done; the rank below adds it to its own.
After ceil(log2 W) rounds rank 0 holds the sum, and tree_and_chain.py's tree sends it back down
in as many rounds. 2 ceil(log2 W) steps against the ring's 2(W-1): fewer fixed costs, but
rank 0 receives, and later sends, the whole tensor in every round: its bytes grow with
log2 W where the ring's stay below twice the tensor.
The order differs from gloo's ring: every element is summed pairwise, neighbours first,
    W = 4:  (x0 + x1) + (x2 + x3)        W = 3:  (x0 + x1) + x2
so for W >= 3 its bits are not gloo's (for W = 2 both are x0 + x1, and a + b is b + a).
tests/test_collectives.py proves it equal to the same additions done in this order in one
process, and measures how far it lands from gloo's; docs/collectives.md gives the figures.
"""

import torch

from ..launch.groups import is_member
from .checks import check_same_shape, flat_memory
from .ops import ReduceOp, check_op, combine, finish
from .p2p import exchange, rank_and_size
from .tree_and_chain import binomial_tree
from .work import launch


def tree_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `tensor` over the ranks, in place, up and down a binomial tree.

    Collective: call on every rank. all_reduce()'s signature."""
    if not is_member(group):
        return None
    flat = flat_memory(tensor, "tree_all_reduce")
    check_op(op, "tree_all_reduce", tensor.dtype)
    return launch(_tree, (tensor, flat, op, group), [tensor], async_op)


def tree_reduce(tensor, op, group):
    """Collective: call on every rank. Reduce onto group rank 0, pairwise, neighbours first."""
    rank, size = rank_and_size(group)
    incoming = torch.empty_like(tensor)
    step = 1
    while step < size:
        if rank % (2 * step) == step:  # my turn to hand my partial sum down; I am done
            exchange(group, sends=[(tensor, rank - step)])
            return
        if rank + step < size:  # rank % (2 * step) == 0: a partner's partial sum comes up
            exchange(group, receives=[(incoming, rank + step)])
            combine(op, tensor, incoming)  # (x_me + ...) + (x_partner + ...)
        step *= 2


def _tree(tensor, flat, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(tensor, group, "tree_all_reduce")
    tree_reduce(flat, op, group)
    binomial_tree(flat, 0, group)  # rank 0's sum, down the same tree
    finish(op, flat, size)

