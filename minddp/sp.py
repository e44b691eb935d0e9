"""Sequence parallelism: what tensor parallelism leaves whole, cut along the sequence instead.

    pytest tests/test_tp.py              # the block with sequence parallel, bitwise vs stock

Read tp.py first. Between a row split and the next column split, tensor parallelism keeps the
activations whole on every rank: the LayerNorms, dropouts and residual adds there run
world_size times on the same numbers, and every rank stores them all. Sequence parallelism
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models") gives
each rank a slice of the sequence there instead, and trades the split's collectives:
  row split, then    reduce_scatter along the sequence (not all_reduce): each rank gets the
                     summed output of its own tokens only;
  column split, before  all_gather along the sequence: the whole sequence again;
  LayerNorm          on this rank's tokens; its weights stay whole on every rank, and their
                     gradient, computed from this rank's tokens only, is summed over ranks.
An all_reduce is a reduce_scatter and an all_gather, so the bytes sent are the same; what
changes is the memory between the splits: 1 / world_size of it.

Stock's names: SequenceParallel() on a LayerNorm, PrepareModuleInput(input_layouts=Shard(1),
desired_input_layouts=Replicate()) on a module whose inputs must be whole, and
RowwiseParallel(output_layouts=Shard(1)) (tp.py).
"""

import torch
import torch.distributed as dist


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
    out = _Sequence.apply(x, dim, group, True)
    out._whole_on_every_rank = True  # a column split after it must not all_reduce again
    return out


def scatter_sequence(x, dim=1, group=None):
    """Collective: sum the ranks' partial outputs, keep this rank's slice (backward: gather)."""
    return _Sequence.apply(x, dim, group, False)


def _gather(x, dim, group):
    # The collectives cut along dim 0: move the sequence there, and back afterwards.
    x = x.movedim(dim, 0).contiguous()
    whole = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    dist.all_gather_single(whole, x, group=group)
    # Back in the usual layout: the Linears after it would each copy a strided input
    # (and save the copy for backward), q, k and v three times over.
    return whole.movedim(0, dim).contiguous()


def _reduce_scatter(x, dim, group):
    x = x.movedim(dim, 0).contiguous()
    mine = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    dist.reduce_scatter_single(mine, x, op=dist.ReduceOp.SUM, group=group)
    return mine.movedim(0, dim).contiguous()


class SequenceParallel:
    """A LayerNorm on this rank's tokens; its weights' gradients summed over ranks."""

    def apply(self, name, module, group):
        for param in module.parameters():
            # Stock leaves this gradient Partial (a DTensor) and sums it when the optimizer
            # reads it; summed here, in backward, it is the same all_reduce of the same parts.
            param.register_hook(lambda grad: _summed(grad, group))


def _summed(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class PrepareModuleInput:
    """Gather the module's first input along the sequence: the modules inside need it whole."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None):
        self.dim = _shard_dim(input_layouts)  # stock's Shard(1) -> 1

    def apply(self, name, module, group):
        module.register_forward_pre_hook(
            lambda m, args: (gather_sequence(args[0], self.dim, group), *args[1:]))


def _shard_dim(layouts):
    layout = layouts[0] if isinstance(layouts, (tuple, list)) else layouts
    return getattr(layout, "dim", None)  # stock's Shard(d) has .dim; Replicate() has none
