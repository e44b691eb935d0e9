"""all_reduce round a ring: a reduce_scatter, then an all_gather, cut where gloo cuts.

    pytest tests/test_collectives.py -k ring_all_reduce   # bit for bit gloo's, any size
    torchrun --nproc_per_node=2 examples/manual_ddp.py --collectives minddp

The tensor is cut into W blocks. ring_reduce_scatter (ring_reduce_scatter.py) leaves rank b with
the complete sum of block b after W - 1 steps; ring_all_gather (ring_all_gather.py) then copies
each rank's finished block to everyone in W - 1 more. Each rank sends 2(W-1)/W of the tensor
in 2(W-1) steps: twice a reduce_scatter's bytes, and no more as W grows.

Which order does each element's sum take? That decides the bits. gloo runs this very ring
(data flowing to rank - 1), so block b is summed x_b + (x_{b+1} + (... + x_{b-1})), and what
is left to match is where gloo cuts its blocks. It sends segments of at most 1 MiB, at least
two per rank and the same number for every rank, all of one size rounded up to a whole
element; rank b's block is segments b*S/W .. (b+1)*S/W - 1 (gloo/allreduce.cc, ring()):
    S = roundup(max(ceil(bytes / 1 MiB), 2W), W)      segments
    n = ceil(N / S) * S/W                             elements in each block but the last
So a small tensor of N elements has blocks of 2*ceil(N/2W), not ceil(N/W) (7 elements on
3 ranks: 4, 3 and 0), and a large one's depend on how many MiB it holds. gloo_blocks() cuts
the same blocks, which makes every element's order gloo's: the tests find the order with
probe values, then check this ring against gloo's all_reduce bit for bit at sizes small and
large, even and odd, in float32, bfloat16 and float64 (docs/collectives.md: the probe).
"""

from ..launch.groups import is_member
from .checks import check_same_shape, flat_memory
from .ops import ReduceOp, check_op, finish
from .p2p import rank_and_size
from .ring_all_gather import ring_all_gather
from .ring_reduce_scatter import ring_reduce_scatter
from .work import launch

SEGMENT_BYTES = 1 << 20  # gloo's kMaxSegmentSize: the most one of its messages carries


def gloo_blocks(flat, size):
    """The W views of 1-D `flat` that gloo's ring all_reduce sums as blocks."""
    numel = flat.numel()
    segments = max(-(-numel * flat.element_size() // SEGMENT_BYTES), 2 * size)
    segments = -(-segments // size) * size  # the same number of segments for every rank
    per_block = -(-numel // segments) * (segments // size)
    # The blocks at the end may be short, or empty: gloo's blocks are all of one size.
    return [flat[min(numel, b * per_block):min(numel, (b + 1) * per_block)]
            for b in range(size)]


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `tensor` over the ranks, in place, round a ring: bit for bit gloo's.

    Collective: call on every rank. Stock's signature (torch.distributed.all_reduce)."""
    if not is_member(group):
        return None
    flat = flat_memory(tensor, "all_reduce")  # in the order it lies in memory, as gloo's
    check_op(op, "all_reduce", tensor.dtype)
    return launch(_ring, (tensor, flat, op, group), [tensor], async_op)


def _ring(tensor, flat, op, group):
    rank, size = rank_and_size(group)
    check_same_shape(tensor, group, "all_reduce")
    blocks = gloo_blocks(flat, size)  # views: the sums land in the tensor itself
    ring_reduce_scatter(blocks, op, group)  # rank b: block b complete
    ring_all_gather(blocks, group)  # every rank: every block complete
    finish(op, flat, size)
