"""The refusals: what a collective can tell is wrong before its first block leaves.

    pytest tests/test_collectives.py -k refuse      # each mistake, its one line, every rank

Locally, for free (check_tensor, check_count): a tensor that is not one dense contiguous
block (send and recv move raw bytes), lists of the wrong length, an output that is not the
input times the world size. ops.py refuses an op this chapter does not reduce with.
Across ranks, for one round of tiny messages (check_same_shape): every rank sends every
other its tensor's size and shape, and compares what comes back. gloo checks nothing: a
peer's block larger than the receiving buffer aborts the receiving process (SIGABRT,
"Received data size doesn't match expected size"), a smaller one is taken silently. Here
every rank sees every shape, so every rank raises the same UsageError at the same point and
none is left waiting. SAME_SHAPE_CHECKED = False leaves the round out (the benchmark times
the algorithms alone; docs/collectives.md gives the round's cost).
"""

import torch

from ..launch.usage_error import UsageError
from .p2p import exchange, rank_and_size

SAME_SHAPE_CHECKED = True
MAX_DIMS = 6  # shapes of more dimensions are compared by their size alone


def check_tensor(tensor, what):
    """One dense, contiguous tensor, or a one-line refusal."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
        raise UsageError(f"{what}: expected a dense torch.Tensor, got {type(tensor).__name__}",
                         hint="pass the tensor itself (sparse tensors: not taught here)")
    if not tensor.is_contiguous():
        raise UsageError(f"{what}: the tensor is not contiguous (send and recv move its"
                         " bytes as they lie)", hint="pass tensor.contiguous(), as gloo needs")


def check_count(what, given, expected, of):
    """`given` things where `expected` are needed (list lengths, sizes), or a refusal."""
    if given != expected:
        raise UsageError(f"{what}: {given} {of}, expected {expected}",
                         hint="one per rank of the group, the same on every rank")


def _header(tensor):
    shape = list(tensor.shape)[:MAX_DIMS] if tensor.dim() <= MAX_DIMS else []
    return [tensor.numel(), tensor.element_size(), tensor.dim()] + shape + \
        [-1] * (MAX_DIMS - len(shape))


def check_same_shape(tensor, group, what):
    """Collective: call on every rank. Refuse, on every rank alike, differing tensors."""
    rank, size = rank_and_size(group)
    if not SAME_SHAPE_CHECKED or size == 1:
        return
    mine = torch.tensor(_header(tensor), dtype=torch.int64)
    everyone = [mine if r == rank else torch.empty_like(mine) for r in range(size)]
    # One round: all headers sent at once (9 int64 each), not a collective of W - 1 steps.
    exchange(group, sends=[(mine, r) for r in range(size) if r != rank],
             receives=[(everyone[r], r) for r in range(size) if r != rank])
    first = everyone[0].tolist()
    for r in range(1, size):
        theirs = everyone[r].tolist()
        if theirs != first:
            raise UsageError(f"{what}: the ranks' tensors differ: group rank 0 has"
                             f" {_describe(first)}, group rank {r} has {_describe(theirs)}",
                             hint="every rank must pass a tensor of the same shape and"
                                  " dtype", same_on_every_rank=True)


def _describe(header):
    numel, element_size, dims = header[:3]
    shape = header[3:3 + dims] if dims <= MAX_DIMS else [f"{numel} elements"]
    return f"shape {list(shape)} ({element_size}-byte elements)"
