"""Ring attention's blocks: chunk_ids and part_of_block against the positions alone.

    minddp grade exercises/ring_attention.py  # checks/ring_attention.py runs these first

chunk_ids: the chunks of each rank at 1 to 8 ranks, in order and zig-zag, against the
positions stock's load balancer gives a rank (_HeadTailLoadBalancer). part_of_block: every
(rank, source) at 2, 3 and 4 ranks, causal and not, in order and zig-zag, two lengths,
against the part the positions alone ask for: the rows that see any of the source's keys,
the keys those rows see, and the causal triangle within them where the mask is not whole (as
tests/context_reference.py derives it). A difference names the rank, the source, and the
pairs computed that the mask excludes or needed and skipped. No process group is needed.
"""

import torch
# Stock's references, imported before any process group exists (as zero.py's).
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer)

from ..shared.training import _ranks, _result


CASES = [(False, False), (True, False), (True, True), (False, True)]  # (causal, zigzag)


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
