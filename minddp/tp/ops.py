"""The operators of tensor parallelism: autograd Functions whose backward is another's forward.

    pytest tests/test_tp.py                 # every one of them, inside stock's plans, bitwise

Megatron's two, around the column and row splits (parallel.py):
  copy_to_ranks   forward: identity     backward: all_reduce  (before a column split: each
                  rank's input gradient holds only its slice's part)
  sum_over_ranks  forward: all_reduce   backward: identity    (after a row split)
and the row split's bias, added as stock adds it (its share on each rank, before the sum).
Sequence parallelism (sequence_parallel.py) trades the pair for two along the sequence, the
same bytes:
  gather_sequence   forward: all_gather   backward: reduce_scatter  (before column splits)
  scatter_sequence  forward: reduce_scatter   backward: all_gather  (after a row split)
"""

import torch
import torch.distributed as dist

from ..launch import groups  # noqa: F401  (torch 2.11 and 2.12: the collectives under 2.13's names)


class _CopyToRanks(torch.autograd.Function):
    """f: the whole input goes on as it is; backward sums the ranks' input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # (autograd may hand the same tensor elsewhere: reduce a copy)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """g: the partial outputs summed over ranks; the gradient of a sum reaches each part whole."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ShareOfBias(torch.autograd.Function):
    """The bias of a row split, divided by world_size: each rank adds its share before the sum.

    Not the whole bias after the all_reduce, as the textbook adds it: stock splits a replicated
    tensor evenly among partial sums (DTensor's rule), which rounds otherwise (break_tp.py
    --break bias-after). The gradient is the whole bias's, on every rank, as stock's.
    """

    @staticmethod
    def forward(ctx, bias, world_size):
        return bias / world_size

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_ranks(x, group=None):
    return _CopyToRanks.apply(x, group)


def sum_over_ranks(x, group=None):
    return _SumOverRanks.apply(x, group)


class _Sequence(torch.autograd.Function):
    """Gather: every rank's slice of dim `dim` -> the whole; backward, the mirror image:
    reduce_scatter (each rank's gradient of the whole is its part of a sum). And back."""

    @staticmethod
    def forward(ctx, x, dim, group, gather):
        ctx.dim, ctx.group, ctx.gather = dim, group, gather
        return _gather(x, dim, group) if gather else _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        flip = _reduce_scatter if ctx.gather else _gather
        return flip(grad, ctx.dim, ctx.group), None, None, None


def gather_sequence(x, dim=1, group=None):
    """Collective: the whole sequence from every rank's slice (backward: reduce_scatter)."""
    return _Sequence.apply(x, dim, group, True)


def scatter_sequence(x, dim=1, group=None):
    """Collective: sum the ranks' partial outputs, keep this rank's slice (backward: gather)."""
    return _Sequence.apply(x, dim, group, False)


def _gather(x, dim, group):
    # The collectives cut along dim 0: move the sequence there, and back afterwards.
    x = x.movedim(dim, 0).contiguous()
    whole = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    # all_gather_single: torch 2.13's name (all_gather_into_tensor, the old one, warns).
    dist.all_gather_single(whole, x, group=group)
    # Back in the usual layout: the Linears after it would each copy a strided input
    # (and save the copy for backward), q, k and v three times over.
    return whole.movedim(0, dim).contiguous()


def _reduce_scatter(x, dim, group):
    x = x.movedim(dim, 0).contiguous()
    mine = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    dist.reduce_scatter_single(mine, x, op=dist.ReduceOp.SUM, group=group)  # (as above)
    return mine.movedim(0, dim).contiguous()


COLLECTIVES = {_CopyToRanks, _SumOverRanks, _Sequence}  # what ends a gathered input's reach


def sequence_dim(layouts):
    """The sequence dimension a layout cuts (stock's Shard(d): d), or None (Replicate())."""
    layout = layouts[0] if isinstance(layouts, (tuple, list)) else layouts
    return getattr(layout, "dim", None)
