"""The sums over tokens: each in C token chunks; sequence parallel's moves, never a sum.

    pytest tests/test_invariant.py -k chunks     # a block at tp = 1, 2, 4, SP on and off

Read chunks.py first. Two kinds of weight are applied to every token and so sum their
gradient over the tokens: a LayerNorm's weight and bias, and a row split's bias (added once,
after the sum over chunks). Under sequence parallel each tp rank holds its own tokens there,
and the sum would be each rank's part, then an all_reduce. Here the tokens are cut into C
chunks on every mesh: each chunk's part is computed alone (the same kernel on a fresh
tensor of the same shape), and the parts are added by tree.py's tree, over tp under
sequence parallel, on the rank without it (where every rank holds every token).
The moves in and out of sequence parallel around the blocks are a slice and a concatenation,
and each one's backward is the other: nothing is added there.
"""

import torch
import torch.distributed as dist

from .tree import tree_sum


def gather_tokens(x, group):
    """Collective over tp: every rank's slice of the tokens (dim 1), whole: a concatenation."""
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 1)


def my_tokens(x, group):
    """This tp rank's slice of the tokens (dim 1), fresh in memory."""
    if group is None:
        return x
    return x.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)].contiguous()


class _Tokens(torch.autograd.Function):
    """In or out of sequence parallel around the blocks: this rank's tokens of a tensor every
    tp rank holds whole (after the embedding), or the whole again (before the head); each
    direction's backward is the other, a slice or a concatenation: no sum, no rounding."""

    @staticmethod
    def forward(ctx, x, group, into):
        ctx.group, ctx.into = group, into
        return my_tokens(x, group) if into else gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        flip = gather_tokens if ctx.into else my_tokens
        return flip(grad, ctx.group), None, None


def sequence_parallel_between(first, last, tp_group):
    """Collective over tp: the blocks between module `first` and module `last` (either may
    be None: on another pipeline stage) see this rank's tokens only."""
    if first is not None:
        first.register_forward_hook(lambda m, args, out: _Tokens.apply(out, tp_group, True))
    if last is not None:
        last.register_forward_pre_hook(
            lambda m, args: (_Tokens.apply(args[0], tp_group, False),))


class _LayerNorm(torch.autograd.Function):
    """Row by row, as nn.LayerNorm: each token chunk alone, its weights' gradient a part."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, n, group):
        xs = [c.contiguous() for c in x.chunk(n, 1)]  # this rank's token chunks, fresh
        outs = [torch.native_layer_norm(c, weight.shape, weight, bias, eps) for c in xs]
        ctx.group, ctx.shape = group, weight.shape
        ctx.save_for_backward(weight, bias, *xs, *(o[1] for o in outs), *(o[2] for o in outs))
        return torch.cat([o[0] for o in outs], 1)

    @staticmethod
    def backward(ctx, grad):
        weight, bias, *saved = ctx.saved_tensors
        n = len(saved) // 3
        xs, means, rstds = saved[:n], saved[n:2 * n], saved[2 * n:]
        parts = [torch.ops.aten.native_layer_norm_backward(
                    g.contiguous(), x, ctx.shape, m, r, weight, bias, [True, True, True])
                 for g, x, m, r in zip(grad.chunk(n, 1), xs, means, rstds)]
        dx = torch.cat([p[0] for p in parts], 1)  # row by row: nothing to add
        return (dx, tree_sum([p[1] for p in parts], ctx.group),
                tree_sum([p[2] for p in parts], ctx.group), None, None, None)


class _AddBias(torch.autograd.Function):
    """y + bias; the bias's gradient, each token chunk's part alone, then the tree."""

    @staticmethod
    def forward(ctx, y, bias, n, group):
        ctx.n, ctx.group = n, group
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        parts = [g.contiguous().sum((0, 1)) for g in grad.chunk(ctx.n, 1)]
        return grad, tree_sum(parts, ctx.group), None, None


def layer_norm(ln, x, token_chunks, sequence_group):
    """`ln` on x, its weights' gradients summed over `token_chunks` chunks (and over
    `sequence_group`, whose ranks hold the other tokens)."""
    return _LayerNorm.apply(x, ln.weight, ln.bias, ln.eps, token_chunks, sequence_group)


def add_bias(y, bias, token_chunks, sequence_group):
    """y + bias, the bias's gradient summed as layer_norm's weights' are."""
    return _AddBias.apply(y, bias, token_chunks, sequence_group)
