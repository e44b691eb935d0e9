"""ZeRO-1's check: ShardedOptimizer against ZeroRedundancyOptimizer, step by step.

    minddp grade exercises/zero.py       # grade.py runs CHECKS["zero"] on every rank

AdamW over the shards, under a DDP, on both models of shared/training.py, the LM with two
parameter groups, and (3+ ranks) the toy model on a process group without rank 0: every
rank's weights after every step, and which parameters each rank keeps optimizer state for.
As every check: it runs on every rank and returns the same results on each.
"""

import torch
import torch.distributed as dist
# Stock's references, imported before any process group exists: importing
# torch.distributed.optim after init_process_group keeps the group alive past its destroy.
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..judge.diagnosis import first_difference
from ..shared.training import MODELS, STEPS, _everyone, _np, _ranks, _result, destroy


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
