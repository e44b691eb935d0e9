"""The grader's check of ring attention (minddp/cp/ring_attention.py) against stock's ring.

    minddp grade exercises/ring_attention.py    # grade.py runs CHECKS["ring_attention"]

Three checks. chunk_ids: the chunks of each rank at 1 to 8 ranks, in order and zig-zag,
against the positions stock's load balancer gives a rank (_HeadTailLoadBalancer).
part_of_block: every (rank, source) at 2, 3 and 4 ranks, causal and not, in order and
zig-zag, two lengths, against the part the positions alone ask for: the rows that see any
of the source's keys, the keys those rows see, and the causal triangle within them where the
mask is not whole (as tests/context_reference.py derives it). A difference names the rank,
the source, and the pairs computed that the mask excludes or needed and skipped. The ring:
the student's ring_attention, forward and backward, against stock's private ring
(_templated_ring_attention and its backward, on the CPU kernel; load balancing for the
causal zig-zag), causal and not, in order and zig-zag, float32 and bfloat16: the output and
the q, k, v gradients of every rank, bit for bit. An output that is not stock's is compared
with the merges of the usual mistakes, each computed here from every rank's blocks. As in
pieces.py: each check returns the same results on every rank.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
# Stock's references, imported before any process group exists (as sharded.py's).
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer)

from ..cp.blockwise import fused
from ..references.stock_context import stock_ring
from .training import _everyone, _ranks, _result

CASES = [(False, False), (True, False), (True, True), (False, True)]  # (causal, zigzag)
# (batch, heads, tokens per rank, head_dim), dtype: the ring merges in float32 whatever
SHAPES = [((2, 3, 8, 8), torch.float32), ((2, 2, 4, 8), torch.bfloat16)]


def _case(causal, zigzag):
    return f"{'causal' if causal else 'no mask'}, {'zig-zag' if zigzag else 'in order'}"


def stock_positions(rank, world_size, zigzag, length):
    """The global positions of rank's `length` tokens, as stock shards a sequence: in order,
    or by its head-tail load balancer (zig-zag)."""
    if not zigzag:
        return list(range(rank * length, (rank + 1) * length))
    order = _HeadTailLoadBalancer(world_size * length, world_size, "cpu")._generate_indices()
    return order.view(world_size, length)[rank].tolist()


def chunks(rank, world_size, zigzag):
    """Stock's chunks of rank (a chunk: length / (2 x ranks) positions zig-zag)."""
    n = 2 * world_size if zigzag else world_size
    positions = stock_positions(rank, world_size, zigzag, 2 * n // world_size)
    return list(dict.fromkeys(p // 2 for p in positions))  # in the order it holds them


def _chunk_ids_check(student, world_size):
    for w in range(1, 9):
        for zigzag in (False, True):
            for r in range(w):
                try:
                    yours = [int(c) for c in student.chunk_ids(r, w, zigzag)]
                except (TypeError, ValueError):
                    yours = None
                stock = chunks(r, w, zigzag)
                if yours != stock:
                    where = (f"chunk_ids({r}, {w}, zigzag={zigzag}): yours {yours}, stock's"
                             f" {stock}")
                    how = (f"rank {r} of {w} holds chunk {r} of {w}" if not zigzag else
                           f"zig-zag cuts the sequence in 2 x {w} = {2 * w} chunks; rank {r}"
                           f" holds an early one, {r}, and its mirror from the end,"
                           f" {2 * w} - 1 - {r} = {2 * w - 1 - r} (stock's head-tail load"
                           f" balancer), in that order")
                    why = f"rank {r} of {w}: yours {yours}, stock's {stock}: {how}"
                    return _result(f"{_ranks(world_size)}, chunk_ids: every rank of 1 to 8, in"
                                   f" order and zig-zag", False, where, why)
    return _result(f"{_ranks(world_size)}, chunk_ids: every rank of 1 to 8, in order and"
                   f" zig-zag", True)


def _sees(q_pos, k_pos, causal):
    q, k = torch.tensor(q_pos), torch.tensor(k_pos)
    return (k[None, :] <= q[:, None]) if causal else torch.ones(len(q), len(k), dtype=torch.bool)


def _indices(part, length):
    """A part's (rows, cols) as index lists and its causal flag."""
    rows, cols, causal = part
    return list(range(length))[rows], list(range(length))[cols], bool(causal)


def _pairs(part, length):
    """The (query, key) pairs a part computes: rows x cols, the triangle if causal (top-left
    aligned within the part, as SDPA's is_causal)."""
    if part is None:
        return set()
    rows, cols, causal = _indices(part, length)
    return {(i, j) for a, i in enumerate(rows) for b, j in enumerate(cols)
            if not causal or b <= a}


def needed(q_pos, k_pos, causal):
    """(rows, cols, causal) as index lists of what the positions ask for, or None."""
    sees = _sees(q_pos, k_pos, causal)
    if not sees.any():
        return None
    rows = sees.any(1).nonzero().flatten().tolist()
    cols = sees[rows].any(0).nonzero().flatten().tolist()
    return rows, cols, not bool(sees[rows][:, cols].all())


def _spans(indices, positions):
    """Indices of this rank's tokens, and the global positions they hold (zig-zag: two runs)."""
    if not indices:
        return "none"
    held = [positions[i] for i in indices]
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]} (positions {held})"
    return f"{indices} (positions {held})"


def _part_check(student, world_size):
    label = (f"{_ranks(world_size)}, part_of_block: every rank and source of 2, 3 and 4 ranks,"
             f" causal and not, in order and zig-zag")
    for w in (2, 3, 4):
        for causal, zigzag in CASES:
            for length in (4, 8):
                for r in range(w):
                    for s in range(w):
                        mine = stock_positions(r, w, zigzag, length)
                        theirs = stock_positions(s, w, zigzag, length)
                        truth = needed(mine, theirs, causal)
                        try:
                            part = student.part_of_block(r, s, causal, zigzag, length)
                            got = None if part is None else _indices(part, length)
                        except (TypeError, ValueError, IndexError):
                            part, got = None, "not (rows, cols, causal) of slices"
                        if got == truth:
                            continue
                        where = (f"{w} ranks, {_case(causal, zigzag)}, {length} tokens a rank:"
                                 f" rank {r}'s queries x the keys of rank {s}: yours "
                                 + ("None" if got is None else str(got) if isinstance(got, str)
                                    else f"rows {_spans(got[0], mine)}, cols"
                                         f" {_spans(got[1], theirs)}, causal {got[2]}")
                                 + ", needed " + ("None" if truth is None else
                                                  f"rows {_spans(truth[0], mine)}, cols"
                                                  f" {_spans(truth[1], theirs)}, causal"
                                                  f" {truth[2]}"))
                        return _result(label, False, where,
                                       _part_why(part, got, truth, mine, theirs, causal, length))
    return _result(label, True)


def _part_why(part, got, truth, mine, theirs, causal, length):
    if isinstance(got, str):
        return ("part_of_block returns None or (rows, cols, causal): rows and cols slices of"
                " this rank's positions")
    sees = _sees(mine, theirs, causal)
    want = {(i, j) for i in range(len(mine)) for j in range(len(theirs)) if sees[i, j]}
    have = _pairs(part, length)
    extra, missing = sorted(have - want), sorted(want - have)
    if extra:
        i, j = extra[0]
        return (f"computes pairs the causal mask excludes ({len(extra)} of them): the query at"
                f" position {mine[i]} (row {i}) sees no key after it, yet yours pairs it with"
                f" the key at position {theirs[j]} (col {j})")
    if missing:
        i, j = missing[0]
        return (f"skips pairs a query needs ({len(missing)} of them): the query at position"
                f" {mine[i]} (row {i}) sees the key at position {theirs[j]} (col {j})"
                + ("" if causal else ": without a mask every query sees every key"))
    return ("the right pairs in another block: stock computes the rows that see any of the"
            " keys and the keys those rows see, the causal mask only where that block is not"
            " whole (one kernel call per block, as stock's ring makes)")


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


CHECKS = {"ring_attention": ring_attention}
