"""The ring's check: ring_reduce_scatter against gloo's all_reduce and reduce_scatter.

    minddp grade exercises/ring.py           # grade.py runs CHECKS["ring"] on every rank

First a dry run (ranks/pairing.py): every send met by a receive as large, link by link, or
the link and the message named where a real run would hang. Then the student's
ring_reduce_scatter on gloo's blocks with the lesson's ring_all_gather after it, against
gloo's all_reduce, and the file's reduce_scatter_tensor against gloo's: SUM, AVG (and MAX),
float32 and bfloat16, sizes W divides and does not, bit for bit; and the elements each rank
sends (a ring's W - 1 blocks). Each check runs on every rank, gathers what every rank saw,
and returns the same results on each: [{"check", "passed", "where", "diagnosis"}], the first
difference and why.
"""

import math

import torch
import torch.distributed as dist

from ..ranks.pairing import unpaired
from ..shared.training import _everyone, _ranks, _result


def ring(student, rank, world_size):
    """ring_reduce_scatter on gloo's blocks, then the lesson's ring_all_gather (the all_reduce
    of ring_all_reduce.py), against gloo's all_reduce; the file's reduce_scatter_tensor
    against gloo's. Bit for bit, every rank: SUM, AVG, MAX, sizes W divides and does not."""
    from ...collectives.ops import finish
    from ...collectives.ring_all_gather import ring_all_gather
    from ...collectives.ring_all_reduce import gloo_blocks
    sizes = (1, 7, 4 * world_size, 4 * world_size + 1, 1000)
    for n in sizes:  # first, without a message moved: a send that no receive meets hangs
        blocks = gloo_blocks(_ring_values(rank, n, torch.float32), world_size)
        hit = unpaired(lambda: student.ring_reduce_scatter(blocks, dist.ReduceOp.SUM, None),
                       f"ring_reduce_scatter of {n} element{'s' * (n != 1)}")
        if hit:
            return [_result(f"{_ranks(world_size)}, ring_reduce_scatter's sends and receives"
                            f" pair up: {', '.join(map(str, sizes))} elements", False, *hit)]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        seen = {}
        for n in sizes:
            x = _ring_values(rank, n, dtype)
            edges = [len(b) for b in gloo_blocks(torch.empty(n), world_size)]
            for op in ("SUM", "AVG", "MAX"):
                yours, stock = x.clone(), x.clone()
                blocks = gloo_blocks(yours, world_size)
                student.ring_reduce_scatter(blocks, getattr(dist.ReduceOp, op), None)
                ring_all_gather(blocks, None)
                finish(getattr(dist.ReduceOp, op), yours, world_size)
                dist.all_reduce(stock, op=getattr(dist.ReduceOp, op))
                block_of = [b for b, length in enumerate(edges) for _ in range(length)]
                key = f"all_reduce {op}, {n} element{'s' * (n != 1)}"
                seen[key] = (x, yours, stock, list(range(n)), block_of, op)
        everyone = _everyone(seen)
        results.append(_result(f"{_ranks(world_size)}, all_reduce (your reduce_scatter, the"
                               f" lesson's all_gather), {str(dtype)[6:]}: SUM, AVG, MAX,"
                               f" {', '.join(map(str, sizes))} elements",
                               *_ring_verdict(everyone, world_size)))
    seen = {}  # (torch 2.13 calls it reduce_scatter_single, and warns at the old name)
    gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    for dtype in (torch.float32, torch.bfloat16):
        for per_rank in (2, 6):  # even: gloo's blocks are the pieces, its bits are the ring's
            x = _ring_values(rank, per_rank * world_size, dtype)
            for op in ("SUM", "AVG"):
                yours, stock = torch.empty(per_rank, dtype=dtype), torch.empty(per_rank,
                                                                                dtype=dtype)
                student.reduce_scatter_tensor(yours, x, op=getattr(dist.ReduceOp, op))
                gloo_reduce_scatter(stock, x, op=getattr(dist.ReduceOp, op))
                seen[f"reduce_scatter_tensor {op}, {str(dtype)[6:]}, {per_rank} elements a"
                     f" rank"] = (x, yours, stock, [rank * per_rank + i for i in
                                                    range(per_rank)], [rank] * per_rank, op)
    everyone = _everyone(seen)
    results.append(_result(f"{_ranks(world_size)}, reduce_scatter_tensor: SUM, AVG, float32"
                           f" and bfloat16", *_ring_verdict(everyone, world_size)))
    results.append(_result(f"{_ranks(world_size)}, what the ring sends: W - 1 blocks a rank",
                           *_ring_sends(student, rank, world_size)))
    return results


def _ring_sends(student, rank, world_size):
    """The elements this rank's ring_reduce_scatter sends, of 4 * W: a ring sends W - 1
    blocks of 4, its (W - 1) / W. (A right result may hide a step too many: the all_gather
    after it overwrites the block that step spoiled.)"""
    from ...collectives.ring_all_reduce import gloo_blocks
    sent, batch, send = [], dist.batch_isend_irecv, dist.send

    def counted_batch(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op.__name__ == "isend")
        return batch(ops)

    def counted_send(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return send(tensor, *args, **kwargs)
    dist.batch_isend_irecv, dist.send = counted_batch, counted_send
    try:
        blocks = gloo_blocks(_ring_values(rank, 4 * world_size, torch.float32), world_size)
        student.ring_reduce_scatter(blocks, dist.ReduceOp.SUM, None)
    finally:
        dist.batch_isend_irecv, dist.send = batch, send
    everyone, ring = _everyone(sum(sent)), 4 * (world_size - 1)
    more = [r for r, elements in enumerate(everyone) if elements > ring]
    if not more:
        return True, ""
    return False, f"rank {more[0]}", (
        f"rank {more[0]} sent {everyone[more[0]]} elements of its {4 * world_size} in"
        f" ring_reduce_scatter, a ring {ring}: W - 1 = {world_size - 1} steps of one block"
        f" each; a step more sends a block already reduced round again (the result can still"
        f" be right: the all_gather after it overwrites that block), and costs what the ring"
        f" saves")


def _ring_values(rank, n, dtype):
    """Rank r's own values: of every size, so that another order rounds another way."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g) * 2.0 ** torch.randint(-4, 5, (n,), generator=g)
            ).to(dtype)


def _ring_verdict(everyone, world_size):
    for key in everyone[0]:
        for rank in range(world_size):
            _, yours, stock, at, block_of, op = everyone[rank][key]
            if torch.equal(yours, stock):
                continue
            i = int((yours != stock).nonzero()[0])
            b = block_of[i]
            where = (f"{key}, rank {rank}, element {i} (block {b}): yours"
                     f" {float(yours[i])!r}, gloo's {float(stock[i])!r}")
            mine = [float(everyone[r][key][0][at[i]]) for r in range(world_size)]
            return False, where, _ring_why(op, mine, b, float(yours[i]), float(stock[i]),
                                           yours.dtype, world_size)
    return True, "", ""


def _ring_why(op, x, b, yours, stock, dtype, world_size):
    """Why block b's element reads `yours`: x[r] is rank r's own value of it."""
    bits = 24 if dtype == torch.float32 else 8
    ulp = 2.0 ** (math.frexp(stock)[1] - bits) if stock else 2.0 ** -126
    tolerance = 2 * world_size * sum(map(abs, x)) * 2.0 ** -bits + ulp

    def of(values):  # the reduction of these ranks' values, exact
        if op == "MAX":
            return max(values)
        return sum(values) / (world_size if op == "AVG" else 1)
    if yours == of([x[b]]) and world_size > 1:
        return (f"block {b} is still rank {b}'s own value: it never travelled round the ring."
                f" In W - 1 = {world_size - 1} step(s) each rank combines the partial sum that"
                f" arrives into its copy of the next block; the last step adds into rank b's"
                f" block b: a step short leaves it as it was")
    if op != "MAX" and abs(yours - of(x)) <= tolerance:
        return (f"every rank's value, added in another order: a rounding difference of"
                f" {abs(yours - stock) / ulp:g} unit(s) of the last place. gloo adds block b as"
                f" x_b + (x_(b+1) + (... + x_(b-1))): what arrives from rank + 1 is added to"
                f" this rank's own copy, mine + arrived, and that sum is sent on to rank - 1")
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
    return (f"a value no reduction of the ranks' values gives (theirs: {x}): blocks mixed up"
            f" (a block index off by one: at step s rank r sends block r + s + 1 and adds"
            f" into block r + s + 2), or a block received into the wrong place")
