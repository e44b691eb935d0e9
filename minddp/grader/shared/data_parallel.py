"""A DDP class beside stock DDP: the run, its verdict, the checks naive's and bucketed's share.

    minddp grade exercises/naive.py      # checks/naive.py and checks/bucketed.py call these

Each model of training.MODELS trains STEPS steps under the student's wrapper and stock's
DistributedDataParallel from each rank's own first weights (a missing broadcast shows),
each rank on its own batches (on_the_models). Then what the models do not reach
(on_the_edges): a step whose first half runs under no_sync(), a layer the forward never
uses, and (at 3 ranks or more) a process group without rank 0. A gradient that is not
stock's bits is judged against the exact average (judge/bound.py): `correct` within the
bound, `failed` beyond it.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..judge.diagnosis import compare
from ..judge.bound import judge, right_ways_of
from .training import (MODELS, STEPS, _everyone, _np, _ranks, _result, _runs, _train, destroy,
                       toy_batch)


class Unused(torch.nn.Module):
    """A layer the forward never calls: its parameters get no gradient, on every rank."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


def _refuses_a_missing_gradient(student, cls_name, rank, world_size):
    """Stock's DDP refuses a parameter that got no gradient (its next forward raises
    "Expected to have finished reduction in the prior iteration"): the student's must
    refuse too, not train on with that gradient never averaged."""
    check = f"{_ranks(world_size)}, a layer the forward never uses (no gradient for it)"
    model = getattr(student, cls_name)(Unused())
    x, y = toy_batch(rank, 0)
    try:
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
    except Exception:  # refused (on every rank alike: each has the unused layer)
        return _result(check, True)
    return _result(check, False, "steps 0 and 1", "unused.weight and unused.bias got no"
                   " gradient, and yours trained on: stock's refuses (its next forward raises);"
                   " register the end-of-backward check on the first gradient, note each"
                   " parameter that arrives, and raise there for the ones that did not")


def _run(student, cls_name, rank, model_spec, group=None, micro=False, **kwargs):
    """The student's wrapper and stock's, on the same start and batches: both records.
    kwargs: for both wrappers (bucket_cap_mb)."""
    _, build, _, make_optimizer, batch, loss_fn = model_spec
    torch.manual_seed(rank)  # each rank its own first weights: the broadcast must fix them
    model = build()
    stock_model = copy.deepcopy(model)
    stock = DistributedDataParallel(stock_model, process_group=group, **kwargs)
    yours = getattr(student, cls_name)(model, process_group=group, **kwargs)
    record = {
        "stock": _train(stock, stock_model, make_optimizer, batch, loss_fn, rank, micro=micro),
        "yours": _train(yours, model, make_optimizer, batch, loss_fn, rank, plain=build(),
                        micro=micro)}
    # Each step's local gradients, for the right ways to average them (judge/bound.py)
    record["yours"]["local"] = [{n: _np(g) for n, g in grads.items()}
                                for grads in record["yours"]["local"]]
    return record


def _verdict(check, everyone, order_note, group=None, mine=None):
    """One result from the group's records (every member's, in group rank order). With a
    `group` that leaves some ranks out: `mine`, this rank's record (None outside it)."""
    size = len(everyone)
    passed, where, why = compare(_runs(everyone, "yours"), _runs(everyone, "stock"), size,
                                 order_note)
    result = _result(check, passed, where, why)
    if not passed and why.startswith("tiny"):  # a rounding apart: right, or wrong?
        # The right ways, from each rank's local gradients, all_reduced now: long after the
        # run, so the collectives pair with nobody's but these (a student's stray one ended).
        mine = everyone[dist.get_rank()] if group is None else mine
        ways = right_ways_of(mine and mine["yours"]["local"], group)
        by_step = [[[e["yours"][key][s] for e in everyone] for s in range(STEPS)]
                   for key in ("grads", "local")]
        correct, at, verdict = judge(*by_step, ways, size)
        result.update(passed=correct, outcome="correct" if correct else "failed",
                      where=where if correct else at, diagnosis=verdict)
    return result


def on_the_models(student, rank, world_size, cls_name, order_note):
    """The student's DDP class against stock DDP on each model of MODELS: gradients every
    step, weights after."""
    results = []
    for spec in MODELS:
        everyone = _everyone(_run(student, cls_name, rank, spec))
        results.append(_verdict(f"{_ranks(world_size)}, {spec[0]}, {spec[2]}", everyone,
                                order_note))
    return results


def on_the_edges(student, rank, world_size, cls_name, order_note):
    """What the models do not reach: a step whose first half runs under no_sync(), a layer
    the forward never uses, and (3+ ranks) a process group without rank 0."""
    results = []
    toy = MODELS[0]
    everyone = _everyone(_run(student, cls_name, rank, toy, micro=True))
    check = f"{_ranks(world_size)}, {toy[0]}, step 1 in two halves, the first under no_sync()"
    called = everyone[0]["yours"].get("in no_sync", {})
    if world_size > 1 and called:  # the same answer, maybe, but the saving is gone
        calls = ", ".join(f"{n} x{c}" for n, c in sorted(called.items()))
        results.append(_result(check, False, f"step 1, the backward under no_sync(): {calls}",
                               "a backward inside no_sync() communicated: stock's makes no"
                               " collective there (it only adds to .grad; the next synced"
                               " backward averages the sum)"))
    else:
        results.append(_verdict(check, everyone, order_note))
    results.append(_refuses_a_missing_gradient(student, cls_name, rank, world_size))
    if world_size >= 3:  # a process group without rank 0: its ranks only, its own size
        group = dist.new_group(list(range(1, world_size)))
        mine = _run(student, cls_name, rank, toy, group=group) if rank else None
        everyone = [e for e in _everyone(mine) if e is not None]
        result = _verdict(f"{_ranks(world_size)}, {toy[0]}, process_group = ranks 1.."
                          f"{world_size - 1}", everyone, order_note, group, mine)
        global_size = f"{(world_size - 1) / world_size:.3f}x stock's"
        if not result["passed"] and result["diagnosis"].startswith(global_size):
            result["diagnosis"] = (f"{global_size}: divided by the whole world's size"
                                   f" ({world_size}), not the group's ({world_size - 1}):"
                                   f" dist.get_world_size(process_group)")
        results.append(result)
        destroy(group)  # `mine`'s wrappers ended with _run
    return results
