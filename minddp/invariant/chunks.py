"""Tensor parallelism in chunks: every split dimension cut into C chunks on every mesh, tp=1 too.

    pytest tests/test_invariant.py -k chunks     # a block at tp = 1, 2, 4: the same bits

tp/parallel.py splits a block's Linears over the tp ranks, and three of its sums then depend
on tp: the row split's output (partial products over a slice of the input features, then an
all_reduce), the column split's input gradient (the same, backwards), and under sequence
parallel the LayerNorms' weight gradients (each rank sums its own tokens). A matmul over a
slice of K is not the same bits as that part of the matmul over all of K, so tp=1 and tp=2
differ. Here the cut is fixed instead: C chunks (a power of two; tp divides it) of the heads,
of the MLP's hidden units and of the tokens, on every mesh. Each chunk is computed alone, by
the same kernel on operands of the same shape, fresh in memory (a view's offset can change a
CPU kernel's bits); tp rank r computes the r-th run of C / tp chunks; and every sum over
chunks is tree.py's: folded on the rank, then added over tp in the tree's order.
  _Enter      a branch's input to each of this rank's chunks; backward: their input
              gradients summed over every chunk (the column split's all_reduce, in order)
  _Leave      the chunks' partial outputs summed over every chunk (the row split's)
  _LayerNorm  row by row as ever; its weights' gradients summed chunk of tokens by chunk
  _AddBias    the row split's bias, once, after the sum; its gradient as the LayerNorm's
Under sequence parallel a rank holds only its own tokens between the branches: _Enter gathers
them, _Leave keeps this rank's tokens of the sum. Without it, every tp rank computes every
token chunk of the LayerNorms, and no sum over tp is needed there.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tp.parallel import keep_slice
from .tree import tree_sum


def _gather_tokens(x, group):
    """Collective over tp: every rank's slice of the tokens (dim 1), whole: a concatenation."""
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 1)


def _my_tokens(x, group):
    if group is None:
        return x
    return x.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)].contiguous()


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, group, sequence_group):
        ctx.group, ctx.sequence_group = group, sequence_group
        whole = _gather_tokens(x, sequence_group)
        return tuple(whole.clone() for _ in range(n))  # each chunk its own input tensor

    @staticmethod
    def backward(ctx, *grads):
        whole = tree_sum(grads, ctx.group)  # the column splits' input gradient, in order
        return _my_tokens(whole, ctx.sequence_group), None, None, None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, sequence_group, *partials):
        ctx.sequence_group, ctx.n = sequence_group, len(partials)
        return _my_tokens(tree_sum(partials, group), sequence_group)  # the row split's sum

    @staticmethod
    def backward(ctx, grad):
        whole = _gather_tokens(grad, ctx.sequence_group)
        return (None, None, *([whole] * ctx.n))  # a sum's gradient reaches each part whole


def _token_sums(grads_by_chunk, group):
    """A weight's gradient: its token chunks' parts, summed in the tree's order."""
    return tree_sum(grads_by_chunk, group)


class _Tokens(torch.autograd.Function):
    """In or out of sequence parallel around the blocks: this rank's tokens of a tensor every
    tp rank holds whole (after the embedding), or the whole again (before the head); each
    direction's backward is the other, a slice or a concatenation: no sum, no rounding."""

    @staticmethod
    def forward(ctx, x, group, into):
        ctx.group, ctx.into = group, into
        return _my_tokens(x, group) if into else _gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        flip = _gather_tokens if ctx.into else _my_tokens
        return flip(grad, ctx.group), None, None


def sequence_parallel_between(first, last, tp_group):
    """Collective over tp: the blocks between module `first` and module `last` (either may
    be None: on another pipeline stage) see this rank's tokens only."""
    if first is not None:
        first.register_forward_hook(lambda m, args, out: _Tokens.apply(out, tp_group, True))
    if last is not None:
        last.register_forward_pre_hook(lambda m, args: (_Tokens.apply(args[0], tp_group, False),))


class _LayerNorm(torch.autograd.Function):
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
        return (torch.cat([p[0] for p in parts], 1), _token_sums([p[1] for p in parts], ctx.group),
                _token_sums([p[2] for p in parts], ctx.group), None, None, None)


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, n, group):
        ctx.n, ctx.group = n, group
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        parts = [g.contiguous().sum((0, 1)) for g in grad.chunk(ctx.n, 1)]
        return grad, _token_sums(parts, ctx.group), None, None


def _chunks(weight, n, dim):
    """This rank's chunks of a weight, each a fresh tensor (a slice's bytes, copied)."""
    return [c.clone() for c in weight.chunk(n, dim)]


def chunk_block(block, chunks, tp_group=None, sequence_parallel=False, drop=None):
    """Collective over tp: `block` (bench/transformer.py's Block) computed in `chunks` chunks,
    this rank's C / tp of them; its split weights sliced as tp/parallel.py slices them.
    drop(y, branch): the residual dropout of this block's branch ("attn" or "mlp")."""
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    for linear, dim in ((block.attn.q, 0), (block.attn.k, 0), (block.attn.v, 0),
                        (block.attn.o, 1), (block.mlp.up, 0), (block.mlp.down, 1)):
        if tp > 1:
            keep_slice(linear, "weight", dim, tp_group, 0)  # columns of o, down; rows of the rest
            if dim == 0:
                keep_slice(linear, "bias", 0, tp_group, 0)
    mine = chunks // tp
    sequence_group = tp_group if sequence_parallel else None
    # The LayerNorms and the row splits' biases: this rank's token chunks under sequence
    # parallel (their sums over tp), every chunk otherwise (each rank has every token).
    token_chunks = mine if sequence_parallel else chunks
    setup = (mine, tp_group, sequence_group, token_chunks, drop or (lambda y, branch: y))
    block.forward = functools.partial(_block_forward, block, *setup)
    return block


def _block_forward(block, mine, group, sequence_group, token_chunks, drop, x):
    x = x + drop(_attention(block, mine, group, sequence_group, token_chunks, x), "attn")
    return x + drop(_mlp(block, mine, group, sequence_group, token_chunks, x), "mlp")


def _layer_norm(ln, x, token_chunks, sequence_group):
    return _LayerNorm.apply(x, ln.weight, ln.bias, ln.eps, token_chunks, sequence_group)


def _attention(block, mine, group, sequence_group, token_chunks, x):
    attn = block.attn
    inputs = _Enter.apply(_layer_norm(block.ln1, x, token_chunks, sequence_group), mine,
                          group, sequence_group)
    weights = [list(zip(_chunks(lin.weight, mine, 0), _chunks(lin.bias, mine, 0)))
               for lin in (attn.q, attn.k, attn.v)]
    outs = _chunks(attn.o.weight, mine, 1)
    partials = []
    for c, h in enumerate(inputs):  # chunk c: its own heads, whole
        B, T, _ = h.shape
        q, k, v = (F.linear(h, w, b).view(B, T, -1, attn.head_dim).transpose(1, 2)
                   for w, b in (weights[0][c], weights[1][c], weights[2][c]))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partials.append(F.linear(y.transpose(1, 2).reshape(B, T, -1), outs[c]))
    out = _Leave.apply(group, sequence_group, *partials)
    return _AddBias.apply(out, attn.o.bias, token_chunks, sequence_group)


def _mlp(block, mine, group, sequence_group, token_chunks, x):
    mlp = block.mlp
    inputs = _Enter.apply(_layer_norm(block.ln2, x, token_chunks, sequence_group), mine,
                          group, sequence_group)
    ups = zip(_chunks(mlp.up.weight, mine, 0), _chunks(mlp.up.bias, mine, 0))
    downs = _chunks(mlp.down.weight, mine, 1)
    partials = [F.linear(F.gelu(F.linear(h, w, b)), down)
                for h, (w, b), down in zip(inputs, ups, downs)]
    out = _Leave.apply(group, sequence_group, *partials)
    return _AddBias.apply(out, mlp.down.bias, token_chunks, sequence_group)
