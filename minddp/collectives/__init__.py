"""Chapter 0: the collectives by hand, every one built from send and receive alone.

    pytest tests/test_collectives.py          # each bit for bit gloo's, or its own order's
    torchrun --nproc_per_node=2 examples/manual_ddp.py --collectives minddp
    minddp collectives-bench                  # timed beside gloo's: the alpha-beta model
    torchrun --nproc_per_node=2 examples/break_collectives.py --break all --timeout 10

Every later lesson calls broadcast, all_reduce, all_gather, reduce_scatter or all_to_all as
one line; this chapter opens them up. Each is written with dist.isend/irecv only (through
p2p.exchange), takes stock's arguments (op=, group= of any ranks, async_op= returning a
Work whose wait() ends it) and is proved against gloo's own collective on 2, 3, 4 and 8
ranks: the same bits on every rank. A reduction's bits depend on the order in which the
ranks' values are added: ring_all_reduce.py says which order gloo takes (found with probe
values, docs/collectives.md) and cuts its ring the same way; the tree and halving-doubling
add in orders of their own, each proved equal to the same additions made in one process.
Read in this order:
    p2p.py                  send and receive at once: the one move everything is made of
    work.py                 async_op: one thread runs the collectives, in call order; Work
    ops.py                  SUM, AVG, PRODUCT, MIN, MAX: how two blocks become one, as gloo's
    checks.py               the refusals and the layouts taken; one round compares shapes
    tree_and_chain.py       broadcast: a binomial tree, and a pipelined chain
    ring_all_gather.py      all_gather round the ring: pass on what came last
    ring_reduce_scatter.py  reduce_scatter round the ring: add what comes, pass the sum on
    ring_all_reduce.py      reduce_scatter + all_gather, cut where gloo cuts: gloo's bits
    ring_reduce.py          reduce: the ring's first half on gloo's reduce cut, then to dst
    tree.py                 all_reduce up and down a binomial tree
    halving_doubling.py     all_reduce in 2 log2 W steps (Rabenseifner)
    pairwise.py             all_to_all by pairwise exchange, W - 1 steps
    dissemination.py        barrier: the dissemination barrier, ceil(log2 W) rounds
    cost.py                 steps and bytes per algorithm: the alpha-beta model
    chosen.py               whose all_reduce naive.py and bucketed.py call
The example that breaks them: examples/break_collectives.py. The docs page, with gloo's
order, the bytes, the measured fit and its picture: docs/collectives.md.
"""

from .dissemination import barrier
from .halving_doubling import halving_doubling_all_reduce
from .pairwise import all_to_all, all_to_all_single
from .ring_all_gather import all_gather, all_gather_into_tensor, all_gather_single
from .ring_all_reduce import all_reduce
from .ring_reduce import reduce
from .ring_reduce_scatter import reduce_scatter, reduce_scatter_single, reduce_scatter_tensor
from .tree import tree_all_reduce
from .tree_and_chain import broadcast, chain_broadcast
from .work import Work

__all__ = ["all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce",
           "all_to_all", "all_to_all_single", "barrier", "broadcast", "chain_broadcast",
           "halving_doubling_all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single",
           "reduce_scatter_tensor", "tree_all_reduce", "Work"]
