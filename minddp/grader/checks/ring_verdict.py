"""The ring's verdict: gloo's bits, correct within the bound of any order, or the mistake named.

    minddp grade exercises/ring.py           # checks/ring.py reads every rank's record here

Each element of a rank's result is its block's reduction of the ranks' own values. Not gloo's
bits but within gamma(W - 1) sum |x_r| of the exact sum (judge/bound.py: any order of adding
W values), every element: correct, and the order named where it is the ring the other way.
Beyond it: what the values say, with what each rank held before the all_gather (where the
ring left each block's whole sum) and the blocks it replaced by new tensors.
"""

import math

import torch

from ..judge.bound import BF16_U, U, any_order


def _ring_verdict(everyone, world_size):
    """passed (gloo's bits), correct (every element within the bound of its exact reduction,
    judge/bound.py: a ring that adds in another order) or failed, with the first element
    beyond it and why."""
    apart = []  # (key, rank, element): each result a rounding apart from gloo's
    for key in everyone[0]:
        for rank in range(world_size):
            _, yours, stock, at, block_of, op, _, replaced = everyone[rank][key]
            if torch.equal(yours, stock):
                continue
            exact, allowed = _exact(everyone, key, rank)
            gap = (yours.double() - exact).abs()
            beyond = (gap > allowed).nonzero()
            i = int(beyond[0]) if len(beyond) else int((yours != stock).nonzero()[0])
            where = (f"{key}, rank {rank}, element {i} (block {block_of[i]}): yours"
                     f" {float(yours[i])!r}, gloo's {float(stock[i])!r}")
            if not len(beyond):
                apart.append((key, rank, i, where))
                continue
            mine = [float(everyone[r][key][0][at[i]]) for r in range(world_size)]
            gone = [r for r in range(world_size) if everyone[r][key][7]]
            if gone:  # (any rank that rebound a block: what the caller holds never changed)
                return False, where, _replaced(gone[0], everyone[gone[0]][key][7])
            return False, where, _ring_why(everyone, key, rank, i, mine, float(allowed[i]))
    if not apart:
        return True, "", ""
    return True, apart[0][3], _ring_correct(everyone, apart, world_size)


def _exact(everyone, key, rank):
    """(exact, allowed) for rank `rank`'s result of `key`: each element's reduction of the
    ranks' own values, exact (float64), and how far a right ring may land from it."""
    _, yours, _, at, _, op, _, _ = everyone[rank][key]
    xs = torch.stack([everyone[r][key][0][at] for r in range(len(everyone))]).double()
    if op == "MAX":  # any order of a max gives the same bits
        return xs.max(0).values, torch.zeros(len(at), dtype=torch.float64)
    u = U if yours.dtype == torch.float32 else BF16_U
    exact, allowed = (torch.from_numpy(a) for a in any_order(xs.numpy(), u))
    if op == "AVG":  # the sum, then one division (ops.finish): a rounding of the result
        exact = exact / len(everyone)
        allowed = allowed / len(everyone) + u * exact.abs()
    return exact, allowed


def _folded(xs, order, op, world_size):
    """The ranks' values `xs` (dtype tensors) added as a ring adds them, mine + arrived:
    x_order[0] + (x_order[1] + (... + x_order[-1])), then AVG's division."""
    total = xs[order[-1]].clone()
    for r in reversed(order[:-1]):
        total = xs[r] + total
    return total / world_size if op == "AVG" else total


def _ring_correct(everyone, apart, world_size):
    """The words of a right result that is not gloo's bits: another order, named where it is
    the other way round the ring."""
    other_way = True
    for key, rank, _, _ in apart:
        _, yours, _, at, block_of, op, _, _ = everyone[rank][key]
        xs = [everyone[r][key][0][at] for r in range(world_size)]
        for b in set(block_of):
            mask = torch.tensor([blk == b for blk in block_of])
            order = [b] + [(b - k) % world_size for k in range(1, world_size)]
            ring = _folded([x[mask] for x in xs], order, op, world_size)
            other_way &= torch.equal(ring, yours[mask])
    units = max(_units(float(everyone[rank][key][1][i]), float(everyone[rank][key][2][i]),
                       everyone[rank][key][1].dtype) for key, rank, i, _ in apart)
    return ("correct, not gloo's bits: every element within the bound of its exact sum"
            " (gamma(W - 1) sum|x_r|: any order of W terms; judge/bound.py), the first of them"
            f" {units:g} unit(s) of the last place from gloo's; "
            + ("your ring runs the other way (to rank + 1): block b is added x_b + (x_(b-1) +"
               " (... + x_(b+1))), gloo's x_b + (x_(b+1) + (... + x_(b-1))): the same sums in"
               " another order (send to rank - 1 and receive from rank + 1 for gloo's bits)"
               if other_way else
               "the same sums in another order than gloo's x_b + (x_(b+1) + (... + x_(b-1)))"))


def _units(yours, stock, dtype):
    """How many units of stock's last place (in `dtype`) apart two values are."""
    return abs(yours - stock) / _ulp(stock, dtype)


def _replaced(rank, blocks):
    return (f"rank {rank} gave blocks[{blocks[0]}] a new tensor (blocks[i] = ...): the caller's"
            f" blocks are views of its own buffer, and those were never written, so it still"
            f" holds its own values. Combine into each block in place: combine(op, mine,"
            f" arrived) writes mine <- op(mine, arrived) where mine lies")


def _ring_why(everyone, key, rank, i, x, allowed):
    """Why element i (of block b) reads as it does on `rank`: x[r] is rank r's own value of
    it; what each rank held before the all_gather tells where the ring left each sum."""
    _, yours, stock, at, block_of, op, held, _ = everyone[rank][key]
    world_size, b = len(everyone), block_of[i]
    dtype = everyone[rank][key][1].dtype
    yours, stock = float(yours[i]), float(stock[i])
    tolerance = allowed + 2 * _ulp(stock, dtype)

    def of(values):  # the reduction of these ranks' values, exact
        if op == "MAX":
            return max(values)
        return sum(values) / (world_size if op == "AVG" else 1)
    ends = [] if held is None else _where_it_ends(everyone, key, i, of(x), tolerance)
    if ends and b not in ends:
        k = ends[0]
        early = k == (b + 1) % world_size
        return (f"block {b}'s whole {op} ends on rank {k}, not on rank {b}: "
                + ("each step works a block early: at step 0 each rank sends its own block"
                   " rank, where the ring starts with block rank + 1" if early else
                   "the ring's blocks are off") +
                ". At step s rank r sends block r + s + 1 (at step 0 its own copy of block"
                " r + 1) and combines what arrives into its block r + s + 2, so that after"
                " W - 1 steps rank b holds block b whole")
    if yours == of([x[b]]) and world_size > 1:
        return (f"block {b} is still rank {b}'s own value: it never travelled round the ring."
                f" In W - 1 = {world_size - 1} step(s) each rank combines the partial sum that"
                f" arrives into its copy of the next block; the last step adds into rank b's"
                f" block b: a step short leaves it as it was")
    copied = [k for k in range(world_size) if k != b and yours == of([x[k]])]
    if copied:
        return (f"block {b} holds rank {copied[0]}'s value alone: each step copied what"
                f" arrived over this rank's own copy instead of combining the two,"
                f" mine <- op(mine, arrived)")
    if op == "MAX" and abs(yours - sum(x)) <= tolerance:
        return ("the ranks' values added, not their MAX: combine with the op,"
                " ops.combine(op, mine, arrived), not +")
    for k in range(world_size):
        if abs(yours - of(x[:k] + x[k + 1:])) <= tolerance:
            return (f"the {op} of W - 1 = {world_size - 1} ranks' values: rank {k}'s is"
                    f" missing" + (f", block {b}'s own: what arrives must be combined with"
                                   f" this rank's copy, mine <- op(mine, arrived), not copied"
                                   f" over it" if k == b else
                                   ": a step short, or a block that left before rank"
                                   f" {k} added to it"))
        if op != "MAX" and abs(yours - of(x + [x[k]])) <= tolerance:
            return (f"rank {k}'s value counted twice: a step too many, or a partial sum"
                    f" combined into a block that already held it")
    if op != "MAX" and abs(yours - of(x)) <= 2.0 ** -10 * sum(map(abs, x)):
        return (f"near the {op} of every rank's value, but {abs(yours - of(x)) / allowed:.3g}x"
                f" as far from it as any order of adding W = {world_size} values may land"
                f" (gamma(W - 1) sum|x_r|, judge/bound.py; {_units(yours, stock, dtype):g}"
                f" units of the last place from gloo's): a wrong value, not another order")
    return (f"a value no reduction of the ranks' values gives (theirs: {x}): blocks mixed up"
            f" (a block index off by one: at step s rank r sends block r + s + 1 and adds"
            f" into block r + s + 2), or a block received into the wrong place")


def _ulp(value, dtype):
    bits = 24 if dtype == torch.float32 else 8
    return 2.0 ** (math.frexp(value)[1] - bits) if value else 2.0 ** -126


def _where_it_ends(everyone, key, i, whole, tolerance):
    """The ranks whose own copy of element i's block held its whole reduction before the
    all_gather (the ring's result: rank b's block b)."""
    _, _, _, at, block_of, _, _, _ = everyone[0][key]
    b = block_of[i]
    offset = i - block_of.index(b)
    return [r for r, e in enumerate(everyone)
            if offset < len(e[key][6][b]) and abs(float(e[key][6][b][offset]) - whole)
            <= tolerance]
