"""reduce: the ranks' tensors reduced onto one rank, by the ring's first half and one gather.

    pytest tests/test_collectives.py -k reduce      # bit for bit dist.reduce's

gloo reduces onto rank dst with the ring of its all_reduce: the ring reduce_scatter leaves
each rank with one block of the sum, each summed in the ring's order (ring_all_reduce.py);
then, instead of an all_gather, every rank sends its finished block straight to dst. Each
rank but dst sends the tensor's size once, (W-1)/W of it round the ring and its own block to
dst; dst receives W - 1 blocks at once, which is where a reduce meets its bottleneck.
The ring is the all_reduce's, the blocks are not (gloo/reduce.cc). Both cut the tensor into
S = roundup(max(ceil(bytes / 1 MiB), 2W), W) segments, S/W a rank; the all_reduce shares the
tensor out over them evenly, the reduce cuts segments of ceil(N / 2W) elements, at most 1 MiB:
    up to 2W MiB    both: blocks of 2 ceil(N / 2W) elements, the same cut
    past 2W MiB     reduce: blocks of S/W whole MiB, the last ones short or empty
So at W = 3, 6 MiB + 4 bytes of float32 is cut into 3 MiB, 3 MiB and 4 bytes for the
reduce, into three blocks of about 2 MiB for the all_reduce. gloo_reduce_blocks() cuts as
the reduce does, so dst's tensor is gloo's bit for bit (tests: probe values show the cut,
random ones the bits, W = 3 and 4, float32, bfloat16 and float16). The other ranks' tensors
stay as they were (ours works on a copy there; stock leaves them unspecified).
"""

from ..launch.groups import is_member
from .checks import check_same_shape, flat_memory
from .ops import ReduceOp, check_op, finish
from .p2p import exchange, group_rank, rank_and_size
from .ring_all_reduce import SEGMENT_BYTES
from .ring_reduce_scatter import ring_reduce_scatter
from .work import launch


def gloo_reduce_blocks(flat, size):
    """The W views of 1-D `flat` that gloo's ring reduce sums as blocks."""
    numel = flat.numel()
    segments = max(-(-numel * flat.element_size() // SEGMENT_BYTES), 2 * size)
    segments = -(-segments // size) * size  # the same number of segments for every rank
    # Where the all_reduce takes ceil(N / S) elements a segment, the reduce takes
    # ceil(N / 2W), at most 1 MiB: the same up to 2W MiB, whole MiB past it.
    per_segment = min(-(-numel // (2 * size)), SEGMENT_BYTES // flat.element_size())
    per_block = per_segment * (segments // size)
    return [flat[min(numel, b * per_block):min(numel, (b + 1) * per_block)]
            for b in range(size)]


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduce `tensor` over the ranks into global rank dst's tensor, in place.

    Collective: call on every rank. Stock's signature (torch.distributed.reduce)."""
    if not is_member(group):
        return None
    flat = flat_memory(tensor, "reduce")  # in the order it lies in memory, as gloo's
    check_op(op, "reduce", tensor.dtype)
    root = group_dst if group_dst is not None else group_rank(group, dst or 0, "reduce")
    return launch(_reduce, (tensor, flat, root, op, group), [tensor], async_op)


def _reduce(tensor, flat, root, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(tensor, group, "reduce")
    # dst sums in its own tensor; the others in a copy, which they drop at the end
    work = flat if rank == root else flat.clone()
    blocks = gloo_reduce_blocks(work, size)
    ring_reduce_scatter(blocks, op, group)
    if rank == root:  # every other rank's block comes to me, all at once
        exchange(group, receives=[(blocks[r], r) for r in range(size) if r != root])
        finish(op, flat, size)
    else:
        exchange(group, sends=[(blocks[rank], root)])
