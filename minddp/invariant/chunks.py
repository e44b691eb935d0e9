"""Tensor parallelism in chunks: every split dimension cut into C chunks on every mesh, tp=1 too.

    pytest tests/test_invariant.py -k chunks     # a block at tp = 1, 2, 4: the same bits

tp/parallel.py splits a block's Linears over the tp ranks, and two of its sums then depend
on tp: the row split's output (partial products over a slice of the input features, then an
all_reduce) and the column split's input gradient (the same, backwards). A matmul over a
slice of K is not the same bits as that part of the matmul over all of K, so tp=1 and tp=2
differ. Here the cut is fixed instead: C chunks (a power of two; tp divides it) of the heads
and of the MLP's hidden units, on every mesh. Each chunk is computed alone, by the same
kernel on operands of the same shape, fresh in memory (a view's offset can change a CPU
kernel's bits); tp rank r computes the r-th run of C / tp chunks; and every sum over chunks
is tree.py's: folded on the rank, then added over tp in the tree's order.
  _Enter       a branch's input, a tensor of its own for each of this rank's chunks;
               backward: their gradients summed over every chunk (the column split's sum)
  _Leave       the chunks' partial outputs summed over every chunk (the row split's sum)
  chunk_block  a transformer block, its attention by chunks of heads, its MLP by chunks of
               hidden units; the LayerNorms and the row split's bias in chunks of tokens
               (tokens.py)
Under sequence parallel a rank holds only its own tokens between the branches: _Enter gathers
them, _Leave keeps this rank's tokens of the sum.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tp.parallel import keep_slice
from .tokens import add_bias, gather_tokens, layer_norm, my_tokens
from .tree import tree_sum


class _Enter(torch.autograd.Function):
    """Forward: n copies of the branch's whole input. Backward: the chunks' sum, in order."""

    @staticmethod
    def forward(ctx, x, n, group, sequence_group):
        ctx.group, ctx.sequence_group = group, sequence_group
        whole = gather_tokens(x, sequence_group)
        return tuple(whole.clone() for _ in range(n))  # each chunk its own input tensor

    @staticmethod
    def backward(ctx, *grads):
        whole = tree_sum(grads, ctx.group)  # the column splits' input gradient, in order
        return my_tokens(whole, ctx.sequence_group), None, None, None


class _Leave(torch.autograd.Function):
    """Forward: the chunks' partial outputs, summed in order. Backward: the sum's gradient."""

    @staticmethod
    def forward(ctx, group, sequence_group, *partials):
        ctx.sequence_group, ctx.n = sequence_group, len(partials)
        return my_tokens(tree_sum(partials, group), sequence_group)  # the row split's sum

    @staticmethod
    def backward(ctx, grad):
        whole = gather_tokens(grad, ctx.sequence_group)
        return (None, None, *([whole] * ctx.n))  # a sum's gradient reaches each part whole


def enter_chunks(x, n, group, sequence_group=None):
    """n tensors of x, whole, one per chunk of this rank; backward: the sum over chunks."""
    return _Enter.apply(x, n, group, sequence_group)


def sum_chunks(group, sequence_group, *partials):
    """The sum of every rank's chunks' partial outputs, in the tree's order."""
    return _Leave.apply(group, sequence_group, *partials)


def fresh_chunks(weight, n, dim):
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


def _attention(block, mine, group, sequence_group, token_chunks, x):
    attn = block.attn
    inputs = enter_chunks(layer_norm(block.ln1, x, token_chunks, sequence_group), mine,
                          group, sequence_group)
    weights = [list(zip(fresh_chunks(lin.weight, mine, 0), fresh_chunks(lin.bias, mine, 0)))
               for lin in (attn.q, attn.k, attn.v)]
    outs = fresh_chunks(attn.o.weight, mine, 1)
    partials = []
    for c, h in enumerate(inputs):  # chunk c: its own heads, whole
        B, T, _ = h.shape
        q, k, v = (F.linear(h, w, b).view(B, T, -1, attn.head_dim).transpose(1, 2)
                   for w, b in (weights[0][c], weights[1][c], weights[2][c]))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partials.append(F.linear(y.transpose(1, 2).reshape(B, T, -1), outs[c]))
    out = sum_chunks(group, sequence_group, *partials)
    return add_bias(out, attn.o.bias, token_chunks, sequence_group)


def _mlp(block, mine, group, sequence_group, token_chunks, x):
    mlp = block.mlp
    inputs = enter_chunks(layer_norm(block.ln2, x, token_chunks, sequence_group), mine,
                          group, sequence_group)
    ups = zip(fresh_chunks(mlp.up.weight, mine, 0), fresh_chunks(mlp.up.bias, mine, 0))
    downs = fresh_chunks(mlp.down.weight, mine, 1)
    partials = [F.linear(F.gelu(F.linear(h, w, b)), down)
                for h, (w, b), down in zip(inputs, ups, downs)]
    out = sum_chunks(group, sequence_group, *partials)
    return add_bias(out, mlp.down.bias, token_chunks, sequence_group)
