"""reduce: the ranks' tensors reduced onto one rank, by the ring's first half and one gather.

    pytest tests/test_collectives.py -k reduce      # bit for bit dist.reduce's

gloo reduces onto rank dst the way its all_reduce reduces: the ring reduce_scatter leaves
each rank with one block of the sum, each summed in the ring's order (ring_all_reduce.py); then,
instead of an all_gather, every rank sends its finished block straight to dst. Each rank
but dst sends the tensor's size once, (W-1)/W of it round the ring and its own block to dst;
dst receives W - 1 blocks at once, which is where a reduce meets its bottleneck.
Cut where gloo cuts (all_reduce.gloo_blocks), each element's order is gloo's, so dst's
tensor is bit for bit gloo's. The other ranks' tensors stay as they were (ours works on a
copy there; stock leaves them unspecified).
"""

from ..launch.groups import is_member
from .checks import check_same_shape, check_tensor
from .ops import ReduceOp, check_op, finish
from .p2p import exchange, group_rank, rank_and_size
from .ring_all_reduce import gloo_blocks
from .ring_reduce_scatter import ring_reduce_scatter
from .work import launch


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduce `tensor` over the ranks into global rank dst's tensor, in place.

    Collective: call on every rank. Stock's signature (torch.distributed.reduce)."""
    if not is_member(group):
        return None
    check_tensor(tensor, "reduce")
    check_op(op, "reduce")
    root = group_dst if group_dst is not None else group_rank(group, dst or 0, "reduce")
    return launch(_reduce, (tensor, root, op, group), [tensor], async_op)


def _reduce(tensor, root, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(tensor, group, "reduce")
    # dst sums in its own tensor; the others in a copy, which they drop at the end
    work = tensor.view(-1) if rank == root else tensor.reshape(-1).clone()
    blocks = gloo_blocks(work, size)
    ring_reduce_scatter(blocks, op, group)
    if rank == root:  # every other rank's block comes to me, all at once
        exchange(group, receives=[(blocks[r], r) for r in range(size) if r != root])
        finish(op, tensor, size)
    else:
        exchange(group, sends=[(blocks[rank], root)])
