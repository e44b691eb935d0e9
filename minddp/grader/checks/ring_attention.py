"""The grader's check of ring attention (minddp/cp/ring_attention.py) against stock's ring.

    minddp grade exercises/ring_attention.py    # grade.py runs CHECKS["ring_attention"]

Three checks: chunk_ids and part_of_block (ring_attention_blocks.py), then the ring: the
student's ring_attention, forward and backward, against stock's private ring
(_templated_ring_attention and its backward, on the CPU kernel; load balancing for the
causal zig-zag), causal and not, in order and zig-zag, float32 and bfloat16: the output and
the q, k, v gradients of every rank, bit for bit. An output that is not stock's is compared
with the merges of the usual mistakes, each computed here from every rank's blocks. As
every check: it returns the same results on every rank.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...cp.blockwise import fused
from ...references.stock_context import stock_ring
from ..shared.training import _everyone, _ranks, _result
from .ring_attention_blocks import (CASES, _case, _chunk_ids_check, _part_check, needed,
                                    stock_positions)


# (batch, heads, tokens per rank, head_dim), dtype: the ring merges in float32 whatever
SHAPES = [((2, 3, 8, 8), torch.float32), ((2, 2, 4, 8), torch.bfloat16)]


def _parts(rank, world_size, seed, shape, dtype=torch.float32):
    """Each rank's own q, k, v and output gradient (its seed), gathered: [what][rank]."""
    g = torch.Generator().manual_seed(seed + rank)
    everyone = []
    for mine in [torch.randn(shape, generator=g).to(dtype) for _ in range(4)]:
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        everyone.append(gathered)
    return everyone


def _stock(parts, rank, causal, zigzag):
    q, k, v, dout = (t[rank] for t in parts)
    return stock_ring(q, k, v, dout, dist.group.WORLD, causal, zigzag and causal)


def _yours(student, parts, rank, causal, zigzag):
    q, k, v = (t[rank].clone().requires_grad_() for t in parts[:3])
    out = student.ring_attention(q, k, v, None, causal, zigzag, "fused")
    out.backward(parts[3][rank])
    return [out.detach(), q.grad, k.grad, v.grad]


def _stock_merge(out, lse, block_out, block_lse):
    return (out - torch.sigmoid(block_lse - lse) * (out - block_out),
            lse - F.logsigmoid(lse - block_lse))


MERGES = {  # a usual mistake -> its merge of (out, lse) with a block's
    "right": _stock_merge,
    "no merge": lambda out, lse, o, l: (o, l),
    "lse not merged": lambda out, lse, o, l: (_stock_merge(out, lse, o, l)[0], lse),
    "averaged": lambda out, lse, o, l: ((out + o) / 2, torch.logaddexp(lse, l)),
    "weights not normalized": lambda out, lse, o, l: (
        torch.exp(lse) * out + torch.exp(l) * o, torch.logaddexp(lse, l)),
}


def _forward_as(parts, rank, world_size, causal, zigzag, merge, in_float32=True):
    """rank's output with the blocks merged by `merge`, in the ring's order; in float32, or
    as the kernel gives them (in_float32=False: a bfloat16 out, a float32 lse)."""
    qs, ks, vs = parts[:3]
    length = qs[0].shape[2]
    mine = stock_positions(rank, world_size, zigzag and causal, length)
    out = lse = None
    for step in range(world_size):
        s = (rank - step) % world_size
        plan = needed(mine, stock_positions(s, world_size, zigzag and causal, length), causal)
        if plan is None:
            continue
        rows, cols, mask = plan
        rows, cols = slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)
        o, l = fused(qs[rank][:, :, rows], ks[s][:, :, cols], vs[s][:, :, cols], mask, None)
        o, l = (o.float(), l.float().unsqueeze(-1)) if in_float32 else (o, l.unsqueeze(-1))
        if out is None:
            out, lse = o, l
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
    return out.to(qs[rank].dtype)


def _ring_check(student, rank, world_size):
    record = {}
    for index, (shape, dtype) in enumerate(SHAPES):
        parts = _parts(rank, world_size, 100 * index, shape, dtype)
        for causal, zigzag in CASES:
            theirs = _stock(parts, rank, causal, zigzag)
            yours = _yours(student, parts, rank, causal, zigzag)
            first = next((i for i, (a, b) in enumerate(zip(yours, theirs))
                          if not torch.equal(a, b)), None)
            if first is None:
                continue
            a, b = yours[first], theirs[first]
            at = tuple(int(i) for i in (a != b).nonzero()[0]) if a.shape == b.shape else None
            seen = {"what": ("the output", "dq", "dk", "dv")[first], "at": at,
                    "yours": None if at is None else a[at].item(),
                    "stock": None if at is None else b[at].item()}
            if first == 0:  # which merge gives the student's output
                seen["as"] = next((name for name, merge in MERGES.items() if torch.equal(
                    _forward_as(parts, rank, world_size, causal, zigzag, merge), a)), None)
                if seen["as"] is None and dtype != torch.float32 and torch.equal(_forward_as(
                        parts, rank, world_size, causal, zigzag, _stock_merge, False), a):
                    seen["as"] = "in the input's dtype"
                seen["close"] = a.shape == b.shape and torch.allclose(
                    a.float(), b.float(), rtol=1e-3 if dtype != torch.float32 else 1e-5,
                    atol=1e-6)
            record[causal, zigzag, index] = seen
    return record


def ring_attention(student, rank, world_size):
    """chunk_ids and part_of_block against stock's positions; the ring against stock's."""
    results = [_chunk_ids_check(student, world_size), _part_check(student, world_size)]
    label = (f"{_ranks(world_size)}, the ring: output, dq, dk, dv of every rank, causal and"
             f" not, in order and zig-zag, float32 and bfloat16")
    everyone = _everyone(_ring_check(student, rank, world_size))
    apart = [(r, key, seen) for r, record in enumerate(everyone) for key, seen in record.items()]
    # an output apart on any rank first: a rank whose output is right and gradients not may
    # only have received another rank's wrong block in the backward
    apart.sort(key=lambda hit: hit[2]["what"] != "the output")  # (stable: rank order kept)
    if not apart:
        return results + [_result(label, True)]
    r, (causal, zigzag, index), seen = apart[0]
    shape, dtype = SHAPES[index]
    where = (f"{_case(causal, zigzag)}, {str(dtype).replace('torch.', '')} {shape},"
             f" rank {r}, {seen['what']}"
             + (f", element {seen['at']}: yours {seen['yours']!r}, stock's"
                f" {seen['stock']!r}" if seen["at"] is not None else ": another shape"))
    return results + [_result(label, False, where, _ring_why(seen, results[1]["passed"]))]


def _ring_why(seen, parts_right):
    if not parts_right:
        return "follows from part_of_block's parts (its check, above)"
    if seen["what"] != "the output":
        return ("the output is stock's, the gradients not: the lse the forward returns (saved"
                " for the backward) is not each row's log-sum-exp over every block: the lse not"
                " combined as the output is (lse - logsigmoid(lse - block_lse), in float32), or"
                " not returned in torch.promote_types(q.dtype, torch.float32)")
    said = {
        "no merge": "each block's result replaces the one before: merge the block's (out, lse)"
                    " into the rows it covers (blockwise.merge), do not assign it",
        "lse not merged": "the lse not combined: each block's out is merged but the running"
                          " lse stays the first block's, so the next merge weighs the blocks"
                          " wrong: lse = lse - logsigmoid(lse - block_lse) too",
        "averaged": "the blocks' outputs averaged: each weighs by its share of the row's"
                    " softmax, sigmoid(block_lse - lse), not one half",
        "weights not normalized": "the blocks weighted by exp(lse) and not normalized: each"
                                  " block's share is exp(lse_B - lse), the max (the whole"
                                  " lse) subtracted",
        "in the input's dtype": "merged in the input's dtype (bfloat16), not float32: stock"
                                " converts each block's out and lse to float32 before the merge"
                                " and the result to q's dtype after",
    }
    if seen.get("as") in said:
        return said[seen["as"]]
    if seen.get("close"):
        return ("the right output within rounding, not stock's bits: stock merges the blocks"
                " in the ring's order (its own block first), in float32, as out - sigmoid("
                "block_lse - lse) * (out - block_out), lse - logsigmoid(lse - block_lse)")
    return ("not the attention of the whole sequence, nor a usual mistake's merge: each step"
            " computes this rank's part of the block it holds (part_of_block) and merges it")
