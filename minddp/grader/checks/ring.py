"""The ring's check: ring_reduce_scatter against gloo's all_reduce and reduce_scatter.

    minddp grade exercises/ring.py           # grade.py runs CHECKS["ring"] on every rank

First a dry run (ranks/pairing.py): every send met by a receive as large, link by link, and
no rank left waiting in a blocking send, or the link and the message named where a real run
would hang. Then the student's ring_reduce_scatter on gloo's blocks with the lesson's
ring_all_gather after it, against gloo's all_reduce, and the file's reduce_scatter_tensor
against gloo's: SUM, AVG (and MAX), float32 and bfloat16, sizes W divides and does not, bit
for bit or, a rounding apart, within the bound of any order of the sums (ring_verdict.py:
`correct`, the ring the other way named); and the elements each rank sends (W - 1 blocks).
Each check runs on every rank, gathers what every rank saw, and returns the same results on
each: [{"check", "passed", "where", "diagnosis"}], the first difference and why.
"""

import contextlib

import torch
import torch.distributed as dist

from ..ranks.pairing import unpaired
from ..shared.training import _everyone, _ranks, _result
from .ring_verdict import _ring_verdict


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
                given = list(blocks)
                student.ring_reduce_scatter(blocks, getattr(dist.ReduceOp, op), None)
                # what each rank holds before the all_gather, and the blocks it replaced
                # (blocks[i] = a new tensor: the caller's buffer never sees it)
                held = [b.clone() for b in blocks]
                replaced = [b for b, t in enumerate(blocks) if t is not given[b]]
                ring_all_gather(blocks, None)
                finish(getattr(dist.ReduceOp, op), yours, world_size)
                dist.all_reduce(stock, op=getattr(dist.ReduceOp, op))
                block_of = [b for b, length in enumerate(edges) for _ in range(length)]
                key = f"all_reduce {op}, {n} element{'s' * (n != 1)}"
                seen[key] = (x, yours, stock, list(range(n)), block_of, op, held, replaced)
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
                held = []
                with _holding(student, held):  # (the file's reduce_scatter calls its ring)
                    student.reduce_scatter_tensor(yours, x, op=getattr(dist.ReduceOp, op))
                gloo_reduce_scatter(stock, x, op=getattr(dist.ReduceOp, op))
                seen[f"reduce_scatter_tensor {op}, {str(dtype)[6:]}, {per_rank} elements a"
                     f" rank"] = (x, yours, stock, [rank * per_rank + i for i in
                                                    range(per_rank)], [rank] * per_rank, op,
                                  held[0] if held else None, [])
    everyone = _everyone(seen)
    results.append(_result(f"{_ranks(world_size)}, reduce_scatter_tensor: SUM, AVG, float32"
                           f" and bfloat16", *_ring_verdict(everyone, world_size)))
    results.append(_result(f"{_ranks(world_size)}, what the ring sends: W - 1 blocks a rank",
                           *_ring_sends(student, rank, world_size)))
    return results


@contextlib.contextmanager
def _holding(student, held):
    """The student's ring_reduce_scatter, as the file's own functions call it, noting in
    `held` what the blocks hold after it."""
    ring_ = student.ring_reduce_scatter

    def noted(blocks, op, group):
        ring_(blocks, op, group)
        held.append([b.clone() for b in blocks])
    student.ring_reduce_scatter = noted
    try:
        yield
    finally:
        student.ring_reduce_scatter = ring_


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
