"""Interleaved 1F1B's check: interleaved_1f1b's lists against stock's schedules'.

    minddp grade exercises/interleaved.py    # grade.py runs CHECKS["interleaved"] on every rank

Against stock's ScheduleInterleaved1F1B and (zero_bubble=True) ScheduleInterleavedZeroBubble,
made on real stages (shared/pipeline_lists.py): the actions each rank runs, in order, its
None slots (the waits: the runner skips them) left out.
As every check: it runs on every rank and returns the same results on each.
"""

from collections import Counter

from torch.distributed.pipelining import (ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)  # before any group

from ..shared.pipeline_lists import (KINDS, LOCAL, _microbatches, _parse, _spell, _stages,
                                     _stock, _strings, _unreadable, accepted)
from ..shared.training import _everyone, _ranks, _result


def interleaved(student, rank, world_size):
    """interleaved_1f1b(rank, W, local, n) against stock's ScheduleInterleaved1F1B, and with
    zero_bubble=True against ScheduleInterleavedZeroBubble: the actions each rank runs, in
    order (its None slots, the waits, left out)."""
    results = []
    for zero_bubble, cls in ((False, ScheduleInterleaved1F1B),
                             (True, ScheduleInterleavedZeroBubble)):
        for local in LOCAL:
            seen = {}
            for n in accepted(world_size):
                stock = _strings(_stock(cls, rank, world_size, local, n).pipeline_order[rank])
                yours = student.interleaved_1f1b(rank, world_size, local, n,
                                                 zero_bubble=zero_bubble)
                seen[n] = ([str(a) for a in yours if a is not None],
                           [a for a in stock if a is not None])
            everyone = _everyone(seen)
            label = (f"{_ranks(world_size)}, {local} stages a rank, "
                     f"{'zero bubble (ZB1P)' if zero_bubble else 'interleaved 1F1B'}:"
                     f" {', '.join(map(str, accepted(world_size)))} microbatches")
            results.append(_result(label, *_interleaved_verdict(everyone, world_size, local,
                                                                 zero_bubble)))
    return results


def _interleaved_verdict(everyone, world_size, local, zero_bubble):
    for n in accepted(world_size):
        for rank in range(world_size):
            yours, stock = everyone[rank][n]
            if yours == stock:
                continue
            at = next((k for k, (a, b) in enumerate(zip(yours, stock)) if a != b),
                      min(len(yours), len(stock)))
            where = (f"{_microbatches(n)}, rank {rank} (stages"
                     f" {_stages(rank, world_size, local)}), action {at}: yours"
                     f" {yours[at] if at < len(yours) else '(none)'}, stock's"
                     f" {stock[at] if at < len(stock) else '(none)'}")
            return False, where, _interleaved_why(yours, stock, at, rank, world_size, local,
                                                  n, zero_bubble)
    return True, "", ""


def _interleaved_why(yours, stock, at, rank, world_size, local, n, zero_bubble):
    if _unreadable(yours):
        return _unreadable(yours)
    per_round = n // max(1, n // world_size)
    hop = 1 if zero_bubble else 2
    kinds = "F, I and W" if zero_bubble else "F and B"
    mine = {_parse(a)[1] for a in yours}
    if zero_bubble and "B" in mine:
        return ("a whole backward (B) in the zero-bubble list: with zero_bubble=True each"
                " backward is split, sIi (the input's gradient) in B's place and sWi (the"
                " weights') later")
    if not zero_bubble and mine & {"I", "W"}:
        return ("I or W actions without zero_bubble: interleaved 1F1B runs each backward"
                " whole, sBi")
    if Counter(yours) != Counter(stock):
        missing = sorted((Counter(stock) - Counter(yours)).elements(), key=stock.index)
        extra = list((Counter(yours) - Counter(stock)).elements())
        how = "repeated" if extra and extra[0] in stock else "not stock's"
        what = f"{_spell(missing[0])} missing" if missing else f"{_spell(extra[0])} {how}"
        return (f"actions missing or repeated ({what}): each of the rank's stages"
                f" ({_stages(rank, world_size, local)}) runs {kinds} of each microbatch once"
                f" (n = {n})" + (": a warm-up is at most n * local forwards" if any(
                    _parse(a)[2] >= n for a in extra) else ""))
    warm_stock = next((k for k, a in enumerate(stock) if _parse(a)[1] != "F"), len(stock))
    warm_yours = next((k for k, a in enumerate(yours) if _parse(a)[1] != "F"), len(yours))
    warmup = min((local - 1) * per_round + hop * (world_size - 1 - rank), n * local)
    if warm_yours == warmup and warm_stock == warmup + 1:  # the warm-up right, then B first
        return (f"after a right warm-up of {warmup} forwards, the steady state: stock runs"
                f" each op's F, then its {'I' if zero_bubble else 'B'} (F first); at action"
                f" {at} yours runs {_spell(yours[at])}, stock's {_spell(stock[at])}")
    if warm_yours != warm_stock:
        theirs = warm_yours - (warm_stock - warmup)  # yours, less the steady state's first F
        other = min((local - 1) * per_round + (3 - hop) * (world_size - 1 - rank), n * local)
        also = ("" if theirs != other or other == warmup else
                " (yours adds 2 a hop, as interleaved 1F1B; zero bubble adds 1)" if zero_bubble
                else " (yours adds 1 a hop, as zero bubble; interleaved 1F1B adds 2)")
        then = (f", then the steady state's first F before its first"
                f" {'I' if zero_bubble else 'B'}" if warm_stock == warmup + 1 else "")
        return (f"the warm-up: stock's rank {rank} runs {warm_stock} forwards before its first"
                f" backward, yours {warm_yours}: a warm-up of min((local - 1) * per_round +"
                f" {hop} * (W - 1 - rank), n * local) = {warmup} forwards (per_round = n //"
                f" max(1, n // W) = {per_round}){then}{also}")
    y, s = _parse(yours[at]), _parse(stock[at])
    if "W" in (y[1], s[1]):
        firsts = [next((k for k, a in enumerate(lst) if _parse(a)[1] == "W"), len(lst))
                  for lst in (yours, stock)]
        before = [sum(_parse(a)[1] == "I" for a in lst[:k]) for lst, k in zip((yours, stock),
                                                                           firsts)]
        if before[0] != before[1]:
            return (f"the Ws: stock's rank {rank} runs {before[1]} I(s) before its first W,"
                    f" yours {before[0]}: after the warm-up, rank r runs r pairs of F and I,"
                    f" then a W after each I (op - warmup >= rank); the Ws left at the end")
        return (f"the Ws' order: stock's W here is {_spell(stock[at])}, yours"
                f" {_spell(yours[at])}: each W is of the oldest I whose W has not run yet, in"
                f" the order the I's ran")
    if y[1] != s[1]:
        return (f"after a right warm-up of {warmup} forwards, the steady state: stock runs one"
                f" F, then one {'I (then a W)' if zero_bubble else 'B'}, in turn, then the"
                f" backwards left; at action {at} yours runs {_spell(yours[at])}, stock's"
                f" {_spell(stock[at])}")
    j = sum(_parse(a)[1] == s[1] for a in stock[:at])  # this action's number among its kind
    if y[0] != s[0] and s[1] == "F":
        return (f"the forwards' stages: stock's forward number {j} runs at stage {s[0]}, yours"
                f" at {y[0]}: per_round = n // max(1, n // W) = {per_round} forwards at a"
                f" local stage, then the next, round-robin over the rank's stages"
                f" ({_stages(rank, world_size, local)}): forward op at local stage (op //"
                f" per_round) % local, stage local_stage * W + rank")
    if y[0] != s[0]:
        return (f"the backwards' stages: stock's backward number {j} runs at stage {s[0]},"
                f" yours at {y[0]}: the backwards go round the rank's stages from the last,"
                f" {per_round} (per_round) at a stage: backward j at local stage local - 1 - (j"
                f" // per_round) % local")
    return (f"stage {s[0]}'s microbatches out of order: yours {_spell(yours[at])}, stock's"
            f" {_spell(stock[at])}; each stage numbers its own {KINDS[s[1]]}s 0, 1, 2, ...")
