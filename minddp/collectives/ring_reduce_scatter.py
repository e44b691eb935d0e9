"""reduce_scatter: the ranks' tensors summed, each rank keeping one 1/W of the sum, round a ring.

    pytest tests/test_collectives.py -k reduce_scatter

Each rank's tensor is cut into W blocks. In the first step every rank sends one of its own
blocks to the rank before it (rank - 1, gloo's direction) and receives a block from the rank
after it, which it adds to its own copy of that block; in every further step it sends on
the partial sum it made in the step before. Block b starts at rank b - 1 and is added to
at ranks b - 2, b - 3, ..., b, so rank b holds the complete sum of block b after W - 1 steps,
added up in this order (gloo's, see ring_all_reduce.py):
    x_b + (x_{b+1} + (... + (x_{b-2} + x_{b-1})))      x_r: rank r's copy of block b
Each rank sends W - 1 blocks, (W-1)/W of the tensor, whatever W is.
gloo's reduce_scatter_tensor sums each element as its all_reduce of the whole input does,
in the order of the gloo block the element falls in (ring_all_reduce.py). Where gloo's blocks
are this function's pieces (up to 2 MiB a rank: an even number of elements a rank), ours
has its bits; elsewhere the two part by a rounding on the elements near the pieces' edges,
and ours equals the sum above (tests; docs/collectives.md). So does a transposed input:
gloo sums it in the order it lies in memory, ours in its rows' order.
ring_reduce_scatter() is also the first half of the ring all_reduce (ring_all_reduce.py).
"""

import torch

from ..launch.groups import is_member
from .checks import check_contiguous, check_count, check_not_permuted, check_output
from .checks import check_same_shape, check_tensor
from .ops import ReduceOp, check_op, combine, finish
from .p2p import exchange, rank_and_size
from .work import launch


def ring_reduce_scatter(blocks, op, group):
    """Collective: call on every rank. Reduce block b over the ranks onto rank b, in place.

    `blocks`: this rank's W tensors, the same sizes on every rank; on return blocks[rank]
    holds the reduction (not yet finished: AVG still divides, ops.finish)."""
    rank, size = rank_and_size(group)
    if size == 1:
        return
    to, came_from = (rank - 1) % size, (rank + 1) % size
    incoming = torch.empty(max(b.numel() for b in blocks), dtype=blocks[0].dtype,
                           device=blocks[0].device)
    for step in range(size - 1):
        mine = blocks[(rank + step + 2) % size]  # the block whose partial sum comes in now
        arrived = incoming[:mine.numel()]
        # Out goes the partial sum made in the step before (at step 0: my own block).
        exchange(group, sends=[(blocks[(rank + step + 1) % size], to)],
                 receives=[(arrived, came_from)])
        combine(op, mine, arrived)  # mine <- mine + theirs: x_me + (what came after me)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `input` over the ranks; keep group rank r's 1/W of the result in `output`.

    Collective: call on every rank. Stock's signature (dist.reduce_scatter_tensor)."""
    if not is_member(group):
        return None
    rank, size = rank_and_size(group)
    check_output(output, "reduce_scatter_tensor")
    check_tensor(input, "reduce_scatter_tensor")  # only read: any layout
    check_op(op, "reduce_scatter_tensor", input.dtype)
    check_count("reduce_scatter_tensor", input.numel(), size * output.numel(),
                "input elements (W times the output's)")
    return launch(_into_output, (output, input, op, group), [output], async_op)


def _into_output(output, input, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(input, group, "reduce_scatter_tensor")
    if output.numel() == 0:
        return
    # A copy, its elements in order whatever the input's layout (gloo sums a transposed
    # input in memory order: the same sums, other roundings); the caller's stays as it was
    work = input.reshape(-1).clone()
    blocks = list(work.split(output.numel()))
    ring_reduce_scatter(blocks, op, group)
    output.copy_(blocks[rank].view(output.shape))  # (any layout: written where it lies)
    finish(op, output, size)


reduce_scatter_single = reduce_scatter_tensor  # torch 2.13's name for it


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce input_list[r] over the ranks into group rank r's `output`.

    Collective: call on every rank. Stock's signature (torch.distributed.reduce_scatter)."""
    if not is_member(group):
        return None
    rank, size = rank_and_size(group)
    check_output(output, "reduce_scatter")
    check_contiguous(output, "reduce_scatter", "torch 2.13's gloo writes such an output wrong")
    check_op(op, "reduce_scatter", output.dtype)
    check_count("reduce_scatter", len(input_list), size, "input tensors")
    for tensor in input_list:
        # (a view with holes, or expanded: read in order, as gloo does)
        check_not_permuted(tensor, "reduce_scatter", "a transposed or permuted input: torch"
                           " 2.13's gloo sums it wrong")
        check_count("reduce_scatter", tuple(tensor.shape), tuple(output.shape),
                    "(an input's shape)")
    return launch(_from_list, (output, list(input_list), op, group), [output], async_op)


def _from_list(output, input_list, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(output, group, "reduce_scatter")
    blocks = [tensor.reshape(-1).clone() for tensor in input_list]  # 1-D, as the ring's
    ring_reduce_scatter(blocks, op, group)
    output.copy_(blocks[rank].view(output.shape))
    finish(op, output, size)
