"""1F1B's check: one_f_one_b's list against the order stock's Schedule1F1B runs.

    minddp grade exercises/pp.py             # grade.py runs CHECKS["pp"] on every rank

Stock's 1F1B on a real stage of each rank, its forwards and backwards recorded as they run,
W and 2W + 1 microbatches; and (3+ ranks) fewer microbatches than stages, against stock's
rule (its Schedule1F1B refuses to run them). Each check runs on every rank, gathers what
every rank saw, and returns the same results on each: [{"check", "passed", "where",
"diagnosis"}], the first difference and why.
"""

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # before any group

from ..shared.training import _everyone, _ranks, _result


def pp(student, rank, world_size):
    """one_f_one_b's list against the order stock's Schedule1F1B runs each stage's actions."""
    results = []
    for n in (world_size, 2 * world_size + 1):
        torch.manual_seed(0)
        stage = PipelineStage(torch.nn.Linear(4, 4), rank, world_size, torch.device("cpu"))
        log = []
        for kind, method in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            original = getattr(stage, method)
            setattr(stage, method, lambda i, *a, _o=original, _k=kind, **k: (
                log.append((_k, i)), _o(i, *a, **k))[1])
        schedule = Schedule1F1B(stage, n, loss_fn=F.mse_loss)
        x, y = torch.randn(2 * n, 4), torch.randn(2 * n, 4)
        if rank == 0:
            schedule.step(x) if world_size > 1 else schedule.step(x, target=y)
        elif rank == world_size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        yours = [tuple(action) for action in student.one_f_one_b(rank, world_size, n)]
        everyone = _everyone((yours, log))
        results.append(_result(f"{_ranks(world_size)}, {n} microbatches",
                               *_order_verdict(everyone, world_size)))
    if world_size > 2:  # fewer microbatches than stages: stock's 1F1B refuses to run it, so
        n = world_size - 1  # the reference is its rule, warm-up min(n, num_stages - stage)
        yours = [tuple(a) for a in student.one_f_one_b(rank, world_size, n)]
        rule = _one_f_one_b_rule(rank, world_size, n)
        everyone = _everyone((yours, rule))
        results.append(_result(f"{_ranks(world_size)}, {n} microbatches (fewer than stages:"
                               f" stock's rule, which its Schedule1F1B refuses to run)",
                               *_order_verdict(everyone, world_size)))
    return results


def _one_f_one_b_rule(stage, num_stages, n):
    """Stock's 1F1B order written out: min(n, num_stages - stage) forwards, then B and F in
    turn, the oldest first, then the backwards left."""
    warmup = min(n, num_stages - stage)
    actions = [("F", i) for i in range(warmup)]
    for i in range(n):
        actions.append(("B", i))
        if warmup + i < n:
            actions.append(("F", warmup + i))
    return actions


def _order_verdict(everyone, world_size):
    for stage, (yours, stock) in enumerate(everyone):
        if yours == stock:
            continue
        at = next((i for i, (a, b) in enumerate(zip(yours, stock)) if a != b),
                  min(len(yours), len(stock)))
        where = (f"stage {stage}, action {at}: yours {_name(yours, at)}, stock's"
                 f" {_name(stock, at)}")
        if sorted(yours) != sorted(stock):
            extra = sorted(set(yours) - set(stock)) or sorted(set(stock) - set(yours))
            return False, where, (f"actions missing or repeated ({_name(extra, 0)}): every"
                                  f" microbatch's F and B once each, n = {len(stock) // 2} of"
                                  f" them (a warm-up of num_stages - stage_index forwards is"
                                  f" at most n)")
        warm = next((i for i, a in enumerate(stock) if a[0] == "B"), len(stock))
        mine = next((i for i, a in enumerate(yours) if a[0] == "B"), len(yours))
        if mine == warm:  # the warm-up is right: what comes after it is not
            return False, where, (f"after a right warm-up of {warm} forwards, the steady"
                                  f" state: stock runs one backward, then one forward, in"
                                  f" turn, the oldest first; at action {at} yours runs"
                                  f" {_name(yours, at)}, stock's {_name(stock, at)}")
        also = (": a warm-up one too long, or a steady state that runs F before B (one list:"
                " stock's runs B, then F)" if mine == warm + 1 else "")
        return False, where, (f"the warm-up: stock runs {warm} forwards before stage"
                              f" {stage}'s first backward (num_stages - stage_index of them,"
                              f" at most n), yours {mine}{also}")
    return True, "", ""


def _name(actions, i):
    return f"{actions[i][0]}{actions[i][1]}" if i < len(actions) else "(none)"
