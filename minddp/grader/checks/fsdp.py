"""FSDP's check: the student's fully_shard against stock's, whole gradients and weights.

    minddp grade exercises/fsdp.py       # grade.py runs CHECKS["fsdp"] on every rank

An MLP whose rows no rank count divides, each layer and the whole sharded, 3 AdamW steps.
A gradient that is not stock's bits, but within a rounding of it, is judged against the
exact average as DDP's are (judge/bound.py): `correct` within the bound, with what differs
from stock named (a reduce per parameter, not one flat buffer; divide before the sum).
As every check: it runs on every rank and returns the same results on each.
"""

import copy

import numpy as np
import torch
import torch.nn.functional as F
# Stock's references, imported before any process group exists (as zero.py's).
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.device_mesh import init_device_mesh as stock_mesh

from ..judge.bound import FSDP_NOTES, judge, right_ways_of
from ..judge.diagnosis import compare
from ..shared.training import STEPS, _everyone, _np, _ranks, _result, _runs, _train


def fsdp(student, rank, world_size):
    """The student's fully_shard against stock's: whole gradients and weights, every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 7),
                                torch.nn.ReLU(), torch.nn.Linear(7, 2))  # rows: 5, 7, 2
    stock, plain = copy.deepcopy(model), copy.deepcopy(model)  # plain: local gradients
    mesh = stock_mesh("cpu", (world_size,))
    for layer in (0, 2, 4):
        student.fully_shard(model[layer])
        stock_fully_shard(stock[layer], mesh=mesh)
    student.fully_shard(model)
    stock_fully_shard(stock, mesh=mesh)

    def batch(rank, step):
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    record = {"stock": _train(stock, stock, adamw, batch, F.mse_loss, rank),
              "yours": _train(model, model, adamw, batch, F.mse_loss, rank, plain=plain)}
    # Each step's local gradients, for the right ways to average them (judge/bound.py)
    record["yours"]["local"] = [{n: _np(g) for n, g in grads.items()}
                                for grads in record["yours"]["local"]]
    everyone = _everyone(record)
    result = _result(f"{_ranks(world_size)}, an MLP whose rows no rank count divides, AdamW",
                     *compare(_runs(everyone, "yours"), _runs(everyone, "stock"), world_size,
                              "stock's reduce_scatter sums, then divides by the world size"))
    if not result["passed"] and _own_blocks(everyone, world_size):
        result["diagnosis"] = ("each rank's rows of the gradient are its own gradient's, not"
                               " the average over the ranks: the gradients were never reduced"
                               " (reduce_scatter with AVG, and keep its result)")
    if not result["passed"] and result["diagnosis"].startswith("tiny"):  # right, or wrong?
        ways = right_ways_of(everyone[rank]["yours"]["local"])  # (every rank alike)
        by_step = [[[e["yours"][key][s] for e in everyone] for s in range(STEPS)]
                   for key in ("grads", "local")]
        correct, at, verdict = judge(*by_step, ways, world_size, notes=FSDP_NOTES)
        result.update(passed=correct, outcome="correct" if correct else "failed",
                      where=result["where"] if correct else at, diagnosis=verdict)
    return [result]


def _own_blocks(everyone, world_size):
    """Whether step 0's whole gradients hold, in each rank's rows, that rank's own local
    gradient (as if nothing was reduced), where the average would be another number."""
    grads, local = everyone[0]["yours"]["grads"][0], [e["yours"]["local"][0] for e in everyone]
    if world_size == 1 or set(grads) != set(local[0]):
        return False
    apart = False
    for name, whole in grads.items():
        if whole is None or local[0][name] is None:
            continue
        rows = -(-len(whole) // world_size)  # torch.chunk's blocks, as fully_shard's
        mean = sum(part[name] for part in local) / world_size
        for r in range(world_size):
            block = slice(r * rows, (r + 1) * rows)
            if not np.allclose(whole[block], local[r][name][block], rtol=1e-5, atol=1e-7):
                return False
            apart |= not np.allclose(whole[block], mean[block], rtol=1e-5, atol=1e-7)
    return apart
