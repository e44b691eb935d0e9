"""The refusals: what a collective can tell is wrong before its first block leaves.

    pytest tests/test_collectives.py -k refuse      # each mistake, its one line, every rank

Locally, for free: lists of the wrong length, an output that is not the input times the
world size (check_count); a layout the collective does not take (below). ops.py refuses an
op this chapter does not reduce with, and AVG on integers.
Layouts, as torch 2.13's gloo takes them (tests: each against stock's same call). send and
recv move a tensor's bytes as they lie, so a collective that sums a tensor in place takes it
as one dense block of memory, in the order it lies there (flat_memory: a transposed view is
summed as gloo sums it); a view with holes, or an expanded one, is refused, as gloo would read
and write numel() elements from where it starts. An input that is only read may have any
layout (its elements are copied in order); an output with holes is written through a
contiguous stand-in (p2p.py), one whose elements share memory (expand) is refused, as torch's
copy_ refuses it.
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
    """A dense torch.Tensor, of any layout, or a one-line refusal."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
        raise UsageError(f"{what}: expected a dense torch.Tensor, got {type(tensor).__name__}",
                         hint="pass the tensor itself (sparse tensors: not taught here)")


def _shared(tensor):
    """Do two of its elements lie in one memory location? (a stride 0: expand)"""
    return any(step == 0 and n > 1 for step, n in zip(tensor.stride(), tensor.shape))


def check_output(tensor, what):
    """A tensor a collective may write: no two of its elements in one memory location."""
    check_tensor(tensor, what)
    if _shared(tensor):
        raise UsageError(f"{what}: more than one element of the output refers to a single"
                         " memory location (an expand()ed tensor; stock: torch's copy_"
                         " refuses it)", hint="pass a tensor of its own: torch.empty(shape)")


def in_memory_order(tensor):
    """Its dims permuted, largest stride first (a transposed view: its storage, in row
    order): contiguous if the tensor is one dense block of memory."""
    return tensor.permute(sorted(range(tensor.dim()), key=lambda dim: -tensor.stride(dim)))


def flat_memory(tensor, what):
    """The tensor's elements as one 1-D view, in the order they lie in memory (what gloo sums
    in place), or a refusal: a tensor that is not one dense block of memory."""
    check_tensor(tensor, what)
    in_memory = in_memory_order(tensor)
    if in_memory.is_contiguous():
        return in_memory.view(-1)
    # torch 2.13's gloo takes numel() elements from where the tensor starts, as if it were
    # contiguous: another view's elements, or (expanded) memory past the tensor's end
    if _shared(tensor):
        layout = "its elements share memory (an expand()ed tensor)"
    else:
        layout = f"it is not one dense block of memory (strides {tuple(tensor.stride())})"
    raise UsageError(f"{what}: {layout}; torch 2.13's gloo reads and writes numel() elements"
                     " from where it starts, as if it were contiguous",
                     hint="pass c = t.contiguous(), then copy it back: t.copy_(c)")


def check_contiguous(tensor, what, why):
    """A contiguous tensor, or a refusal that says why this collective needs one."""
    check_tensor(tensor, what)
    if not tensor.is_contiguous():
        raise UsageError(f"{what}: the tensor is not contiguous ({why})",
                         hint="pass t.contiguous() (an output: then copy it into t)")


def check_not_permuted(tensor, what, why):
    """Refuse a dense block laid out in another order than its rows (a transposed view)."""
    check_tensor(tensor, what)
    if not tensor.is_contiguous() and in_memory_order(tensor).is_contiguous():
        check_contiguous(tensor, what, why)


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
