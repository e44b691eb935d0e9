"""ReduceOp: how two ranks' values become one (SUM, AVG, PRODUCT, MIN, MAX), as gloo does it.

    pytest tests/test_collectives.py -k ops      # each op bit for bit gloo's, three dtypes

Every reducing algorithm here holds a block of its own and receives a peer's, and combines
the two in place: combine(op, mine, received). gloo does the same, elementwise, in the
tensor's own dtype: a bfloat16 sum is rounded to bfloat16 after every addition, exactly what
torch.add does to two bfloat16 tensors, so the bits agree as long as the additions happen
in the same order (ring_all_reduce.py: which order that is). AVG is gloo's SUM followed by one
true division by the world size, on every rank, at the very end (tests: equal to gloo's own
AVG bit for bit; a multiplication by 1/W would not be). On an integer or bool tensor stock's
AVG sums, then raises on every rank (the division's float does not fit): refused here first.
"""

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError

ReduceOp = dist.ReduceOp

COMBINE = {  # the op -> how two tensors become one (out= the first: in place)
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,  # a sum until finish() divides it
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,  # NaN wins, as in gloo
    ReduceOp.MAX: torch.maximum,
}


def check_op(op, what, dtype):
    """Refuse, in one line, an op this chapter does not reduce with, or AVG on integers
    (before any message: stock's gloo sums, then fails to divide, on every rank)."""
    kind = getattr(op, "op", op)  # PREMUL_SUM comes wrapped in a ReduceOp object
    if kind == ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise UsageError(f"{what}: op=ReduceOp.AVG on a {dtype} tensor (an average of"
                         " integers is no integer: stock's sums, then fails to divide in"
                         " place, on every rank)",
                         hint="SUM, then divide a floating-point copy by the world size")
    if kind in COMBINE:
        return
    name = getattr(kind, "name", repr(op))
    why = {"PREMUL_SUM": "nccl's; gloo has none (torch says: Cannot use ReduceOp.PREMUL_SUM"
                         " with Gloo)"}.get(name, "gloo has it for integer tensors only")
    raise UsageError(f"{what}: op=ReduceOp.{name} is not one of this chapter's reductions"
                     f" ({why})", hint="use SUM, AVG, PRODUCT, MIN or MAX")


def combine(op, mine, received):
    """mine <- op(mine, received), elementwise, in place."""
    COMBINE[getattr(op, "op", op)](mine, received, out=mine)


def finish(op, tensor, world_size):
    """The last touch once the reduction is complete: AVG divides the sum by the world size."""
    if getattr(op, "op", op) == ReduceOp.AVG:
        tensor.div_(world_size)
