"""The grader's checks of the sharded exercises: ZeRO-1's optimizer and FSDP's fully_shard.

    minddp grade exercises/zero.py       # grade.py runs CHECKS[exercise] on every rank

An FSDP gradient that is not stock's bits, but within a rounding of it, is judged against
the exact average as DDP's are (bound.py): `correct` within the bound, with what differs
from stock named (a reduce per parameter, not one flat buffer; divide before the sum).
As in checks.py: each check runs on every rank and returns the same results on each.
"""

import copy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
# Stock's references, imported before any process group exists: importing
# torch.distributed.optim after init_process_group keeps the group alive past its destroy.
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.nn.parallel import DistributedDataParallel

from .bound import FSDP_NOTES, judge, right_ways_of
from .diagnosis import compare, first_difference
from .training import MODELS, STEPS, _everyone, _np, _ranks, _result, _runs, _train, destroy


def _two_groups(params):
    """Two parameter groups, the second with its own lr: stock shards across both at once."""
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], "lr": 5e-3}]


def zero(student, rank, world_size):
    """ShardedOptimizer against ZeroRedundancyOptimizer: weights every step, state held."""
    results = []
    cases = [(label, build, batch, loss_fn, False) for label, build, _, _, batch, loss_fn in MODELS]
    cases.append((MODELS[1][0] + ", two parameter groups", *MODELS[1][1:2], *MODELS[1][4:], True))
    if world_size >= 3:  # a process group without rank 0: its ranks only, its own ranks
        cases.append((MODELS[0][0] + f", process_group = ranks 1..{world_size - 1} (ranks"
                      f" below: the group's)", *MODELS[0][1:2], *MODELS[0][4:], "subgroup"))
    for label, build, batch, loss_fn, grouped in cases:
        group = dist.new_group(list(range(1, world_size))) if grouped == "subgroup" else None
        record = None if group is not None and rank == 0 else {}  # rank 0: not in the group
        for who in ("stock", "yours") if record is not None else ():
            torch.manual_seed(0)
            model = DistributedDataParallel(build(), process_group=group)
            params = [p for p in model.parameters() if p.requires_grad]
            given = _two_groups(params) if grouped is True else params
            optimizer = (student.ShardedOptimizer(given, torch.optim.AdamW, process_group=group,
                                                  lr=1e-2)
                         if who == "yours" else ZeroRedundancyOptimizer(
                             given, optimizer_class=torch.optim.AdamW, process_group=group,
                             lr=1e-2))
            weights = []
            for step in range(STEPS):
                x, y = batch(rank, step)
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
                weights.append({n: _np(p) for n, p in model.module.named_parameters()})
            held = sorted(i for i, p in enumerate(params) if p in optimizer.optim.state)
            record[who] = {"weights": weights, "held": held, "given": len(params)}
        everyone = _everyone(record)
        if group is not None:
            everyone = everyone[1:]  # the group's ranks, in its order
            model = optimizer = None  # stock's DDP and optimizer hold the group: gone first
            destroy(group)
        results.append(_result(f"{_ranks(world_size)}, {label}, AdamW over the shards",
                               *_zero_verdict(everyone, len(everyone))))
    return results


def _zero_verdict(everyone, world_size):
    for step in range(STEPS):
        for rank in range(world_size):
            hit = first_difference(everyone[rank]["yours"]["weights"][step],
                                   everyone[rank]["stock"]["weights"][step])
            if hit is None:
                continue
            where = f"weights after step {step}, rank {rank}, {hit[0]}"
            apart = [r for r in range(world_size) if first_difference(
                everyone[r]["yours"]["weights"][step], everyone[0]["yours"]["weights"][step])]
            if apart:
                return (False, where, f"rank {apart[0]} holds other weights than rank 0: an"
                        f" updated shard never reached it (broadcast each parameter from the"
                        f" rank that owns it, after the step)")
            return False, where, "every rank holds the same, but not stock's update: the step"
    for rank in range(world_size):
        yours, stock = everyone[rank]["yours"]["held"], everyone[rank]["stock"]["held"]
        if yours != stock:
            every = len(yours) == everyone[rank]["yours"]["given"]
            return (False, f"rank {rank} keeps optimizer state for parameters {yours},"
                           f" stock's rank {rank} for {stock}",
                    "every rank keeps state for every parameter: its optimizer was given all"
                    " of them, not its shard" if every and world_size > 1 else
                    "the shards are not stock's: largest parameters first, each to the rank"
                    " holding the fewest elements so far (the lowest rank on a tie)")
    return True, "", ""


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
    # Each step's local gradients, for the right ways to average them (bound.py)
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


CHECKS = {"zero": zero, "fsdp": fsdp}
