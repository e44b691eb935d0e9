"""The vocabulary in chunks: the embedding and the loss split over tp, the same chunks on any mesh.

    pytest tests/test_invariant.py -k vocab      # a vocabulary C does not divide, tp = 1, 2

The embedding's table and the output layer have a row per token of the vocabulary, the
model's largest weights. Megatron cuts them over tp by rows (vocabulary-parallel): each tp
rank looks up only the tokens in its rows, and holds only its rows' logits. Two sums then
cross the cut: the loss's softmax denominator (a sum of exp over the whole vocabulary), and
the output layer's input gradient (a sum over every row, as a column split's). Here the rows
are cut into C chunks on every mesh, tp rank r holding the r-th run of C / tp of them, and
both sums are tree.py's, over chunks. A vocabulary that C does not divide is padded with
rows no token names, whose logits are -inf: a padded row never changes a sum. (Padding to
a multiple of tp instead, as a vocabulary cut by ranks needs, would make the rows, and the
bits, depend on the mesh.) The max in the softmax and the picked target's logit need no
order: a max is exact in any order, and a sum of one logit and zeros too.
  chunk_vocabulary  the table padded and cut, the embedding's and the head's forward taken
                    over, and the loss: loss_fn(hidden, targets), the mean over the tokens
"""

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tp.plan import SLICES
from .chunks import fresh_chunks, sum_chunks
from .tree import tree_sum


class _VocabLoss(torch.autograd.Function):
    """Cross-entropy over this rank's chunks of the vocabulary, sums over chunks in order."""

    @staticmethod
    def forward(ctx, h, targets, vocab, first, group, *weights):
        size = weights[0].shape[0]
        logits = [F.linear(h, w) for w in weights]  # (B, T, size) each, one matmul a chunk
        for c, chunk in enumerate(logits):
            padding = max(0, min(size, first + (c + 1) * size - vocab))
            if padding:  # rows no token names: out of every sum
                chunk[..., size - padding:] = -math.inf
        top = torch.stack([chunk.amax(-1) for chunk in logits]).amax(0)
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # a max: any order
        exps = [torch.exp(chunk - top.unsqueeze(-1)) for chunk in logits]
        total = tree_sum([e.sum(-1) for e in exps], group)  # the softmax's denominator
        picked = tree_sum([_pick(chunk, targets, first + c * size, 0.0)
                           for c, chunk in enumerate(logits)], group)  # one logit, zeros
        ctx.save_for_backward(h, targets, total, *weights, *exps)
        ctx.first, ctx.group = first, group
        return (total.log() + top - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        h, targets, total, *rest = ctx.saved_tensors
        weights, exps = rest[:len(rest) // 2], rest[len(rest) // 2:]
        size, scale = weights[0].shape[0], grad / targets.numel()  # the mean's share
        dlogits = [(e / total.unsqueeze(-1) - _pick(e, targets, ctx.first + c * size, 1.0,
                                                    one_hot=True)) * scale
                   for c, e in enumerate(exps)]
        dh = tree_sum([d @ w for d, w in zip(dlogits, weights)], ctx.group)  # in order
        dw = [d.reshape(-1, size).T @ h.reshape(-1, h.shape[-1]) for d in dlogits]
        return (dh, None, None, None, None, *dw)


def _pick(chunk, targets, start, fill, one_hot=False):
    """Each token's target's entry of this chunk (fill where the target is elsewhere), or
    (one_hot) a chunk-shaped tensor of 1.0 at each target in the chunk, 0 elsewhere."""
    local = targets - start
    inside = (local >= 0) & (local < chunk.shape[-1])
    index = local.clamp(0, chunk.shape[-1] - 1).unsqueeze(-1)
    if one_hot:
        return torch.zeros_like(chunk).scatter_(-1, index, inside.unsqueeze(-1).to(chunk.dtype))
    return torch.where(inside, chunk.gather(-1, index).squeeze(-1), fill)


def _slice(module, attr, rows, first, group):
    """module.<attr>: this rank's rows of the table, padded with zero rows to the chunks'."""
    table = getattr(module, attr)
    padded = F.pad(table.detach(), (0, 0, 0, rows * _size(group) - len(table)))
    piece = torch.nn.Parameter(padded[first:first + rows].clone(), table.requires_grad)
    setattr(module, attr, piece)
    if group is not None:
        SLICES.setdefault(module, {})[attr] = (0, group)  # gradient tables gather the rows
    return piece


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def chunk_vocabulary(embedding, head, chunks, vocab, tp_group=None):
    """Collective over tp: `embedding` and `head` (bench/transformer.py's; either None on a
    pipeline stage without it) on this rank's C / tp chunks of the vocabulary's rows.
    Returns loss_fn(hidden, targets), the head's output layer inside it."""
    tp = _size(tp_group)
    size = math.ceil(vocab / chunks)  # rows per chunk, the padding in the last ones
    mine, rows = chunks // tp, size * (chunks // tp)
    first = rows * (0 if tp_group is None else dist.get_rank(tp_group))
    tied = (embedding is not None and head is not None
            and head.lm_head.weight is embedding.wte.weight)
    if embedding is not None:
        table = _slice(embedding.wte, "weight", rows, first, tp_group)
        embedding.forward = functools.partial(_embed, embedding, size, first, mine, tp_group)
    if head is not None:
        if tied:
            head.lm_head.weight = table
        else:
            _slice(head.lm_head, "weight", rows, first, tp_group)
        head.forward = lambda x: head.ln_f(x)  # the output layer moves into the loss
    return lambda h, targets: _VocabLoss.apply(
        h, targets, vocab, first, tp_group, *fresh_chunks(head.lm_head.weight, mine, 0))


def _embed(embedding, size, first, mine, group, idx):
    """Each token's row from the chunk that holds it (zeros from the others), summed over the
    chunks in the tree's order: exact, as one row and zeros add up to that row."""
    parts = []
    for c, table in enumerate(fresh_chunks(embedding.wte.weight, mine, 0)):
        local = idx - (first + c * size)
        inside = ((local >= 0) & (local < size)).unsqueeze(-1)
        parts.append(F.embedding(local.clamp(0, size - 1), table) * inside)
    return sum_chunks(group, None, *parts) + embedding.wpe(embedding.positions)
