"""The grader's checks of the pipeline's lists past 1F1B: interleaved 1F1B (and its zero-bubble
form, ZB1P), and the pass that adds the zero-bubble schedule's waits.

    minddp grade exercises/interleaved.py    # grade.py runs CHECKS[exercise] on every rank
    minddp grade exercises/zero_bubble.py

Stock writes every rank's list when a schedule is made (`pipeline_order`: what its runtime
runs, action for action, tests/test_pp_interleaved.py). Each rank makes stock's schedule on
real stages of its own (stage s on rank s % W), 2 and 3 stages a rank, every microbatch count
of 1-9 that stock accepts (n a multiple of its rounds, max(1, n // W)), and compares. An
action reads as stock writes it, "sFi": stage s runs F (forward), B (backward), I (the
input's gradient) or W (the weights') of microbatch i; None is a slot the rank waits.
"""

import re
from collections import Counter

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)  # before any group
from torch.distributed.pipelining.schedules import _Action

from .training import _everyone, _ranks, _result

COUNTS = (1, 2, 3, 4, 5, 6, 8, 9)  # microbatches: those stock accepts at W ranks
LOCAL = (2, 3)  # stages per rank
KINDS = {"F": "forward", "B": "backward", "I": "input's gradient", "W": "weights' gradient"}


def accepted(world_size):
    """The counts stock's interleaved schedules accept: n a multiple of max(1, n // W)."""
    return [n for n in COUNTS if n % max(1, n // world_size) == 0]


def _stock(cls, rank, world_size, local, n):
    """Stock's schedule on this rank's real stages (rank, rank + W, ...): nothing runs."""
    stages = [PipelineStage(torch.nn.Linear(4, 4), s, local * world_size, torch.device("cpu"))
              for s in range(rank, local * world_size, world_size)]
    return cls(stages, n, loss_fn=F.mse_loss)


def _strings(actions):
    return [None if a is None else str(a) for a in actions]


def _parse(action):
    """"12I3" -> (12, "I", 3)."""
    stage, kind, i = re.fullmatch(r"(\d+)([FBIW])(\d+)", action).groups()
    return int(stage), kind, int(i)


def _unreadable(actions):
    """One line for an action that is not "sFi" (a tuple, a typo), or ""."""
    bad = next((a for a in actions if a is not None and not re.fullmatch(r"\d+[FBIW]\d+", a)),
               None)
    return "" if bad is None else (f"an action written {bad!r}: each is a string \"sFi\" (stage,"
                                   f" F/B/I/W, microbatch: _action(s, kind, i)) or None")


def _spell(action):
    if action is None:
        return "(none)"
    stage, kind, i = _parse(action)
    return f"{action} (stage {stage}'s {KINDS[kind]} of microbatch {i})"


def _stages(rank, world_size, local):
    return ", ".join(str(s) for s in range(rank, local * world_size, world_size))


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


def zero_bubble(student, rank, world_size):
    """add_bubbles(every rank's list, stages) against stock's ScheduleInterleavedZeroBubble:
    every slot, None included; then on the same lists packed (their None slots taken out)
    against stock's own pass, _add_bubbles_to_actions, where many forwards must wait."""
    results = []
    for packed in (False, True):
        for local in LOCAL:
            seen, num_stages = {}, local * world_size
            for n in accepted(world_size):
                schedule = _stock(ScheduleInterleavedZeroBubble, rank, world_size, local, n)
                lists = [_strings(schedule._calculate_single_rank_operations(r))
                         for r in range(world_size)]
                if packed:
                    lists = [[a for a in lst if a is not None] for lst in lists]
                    schedule.pipeline_order = {r: [_Action.from_str(a) for a in lst]
                                               for r, lst in enumerate(lists)}
                    stock = _strings_of(schedule._add_bubbles_to_actions(num_stages))
                else:
                    stock = _strings_of(schedule.pipeline_order)
                yours = student.add_bubbles([list(lst) for lst in lists], num_stages)
                seen[n] = (lists, [str(a) if a is not None else None for a in yours[rank]],
                           stock)
            everyone = _everyone(seen)
            what = ("the lists packed (no None), against stock's own pass" if packed else
                    "the zero-bubble lists")
            label = (f"{_ranks(world_size)}, {local} stages a rank, {what}:"
                     f" {', '.join(map(str, accepted(world_size)))} microbatches, every slot")
            results.append(_result(label, *_bubbles_verdict(everyone, world_size)))
    return results


def _strings_of(order):
    return [_strings(order[r]) for r in range(len(order))]


def _bubbles_verdict(everyone, world_size):
    for n in everyone[0]:
        lists, _, stock_all = everyone[0][n]
        yours_all = [everyone[r][n][1] for r in range(world_size)]
        firsts = {r: next((k for k, (a, b) in enumerate(zip(yours_all[r], stock_all[r]))
                           if a != b), min(len(yours_all[r]), len(stock_all[r])))
                  for r in range(world_size) if yours_all[r] != stock_all[r]}
        if not firsts:
            continue
        rank = min(firsts, key=lambda r: (firsts[r], r))  # the earliest slot: later ones echo it
        at, yours, stock = firsts[rank], yours_all[rank], stock_all[rank]
        where = (f"{_microbatches(n)}, rank {rank}, slot {at}: yours"
                 f" {yours[at] if at < len(yours) else '(the end)'}, stock's"
                 f" {stock[at] if at < len(stock) else '(the end)'}")
        return False, where, _bubbles_why(lists[rank], yours_all, stock_all, rank, at)
    return True, "", ""


def _slot(lists, action):
    """The slot `action` runs in, over every rank's list (None: nowhere)."""
    return next((k for lst in lists for k, a in enumerate(lst) if a == action), None)


def _bubbles_why(given, yours_all, stock_all, rank, at):
    yours, stock = yours_all[rank], stock_all[rank]
    if _unreadable(yours):
        return _unreadable(yours)
    ran, listed = [a for a in yours if a], [a for a in given if a]
    if ran != listed:
        missing = sorted((Counter(listed) - Counter(ran)).elements(), key=listed.index)
        extra = list((Counter(ran) - Counter(listed)).elements())
        what = (f"{_spell(missing[0])} is lost" if missing else
                f"{_spell(extra[0])} is {'repeated' if extra[0] in listed else 'not in it'}"
                if extra else "its actions run in another order")
        return (f"rank {rank}'s list changed: {what}. The pass only adds None slots: a forward"
                f" that waits gets a None and still runs, in a later slot; every action of"
                f" the list stays, in its order")
    if at >= len(yours) or at >= len(stock):
        return (f"yours {'ends' if at >= len(yours) else 'goes on'} at slot {at}, stock's"
                f" {'goes on' if at >= len(yours) else 'ends'}: the pass stops when every"
                f" rank's list is used up")
    at_list = sum(a == b for a, b in zip(stock[:at], _pointed(given, stock[:at])))
    following = given[at_list] if at_list < len(given) else None
    y, s = yours[at], stock[at]
    if s is None and following is None:
        return (f"rank {rank}'s list has a None of its own here (its entry {at_list}): a None"
                f" in a rank's list is a slot it waits, copied as it is, and the pass moves on;"
                f" yours runs {_spell(y)} in its place")
    if s is None:  # stock waits: the following action is a forward whose input is not there
        stage, _, i = _parse(following)
        ready = _slot(yours_all, f"{stage - 1}F{i}")
        when = ("in the same slot (on another rank): what a slot places counts as done only"
                " from the next slot" if ready == at else
                "in no slot before it" if ready is None or ready > at else f"in slot {ready}")
        return (f"yours runs {_spell(y)} at slot {at}, where stock waits (None): its input,"
                f" {stage - 1}F{i}, runs {when}; a forward waits until the stage before has"
                f" made its input in an earlier slot")
    stage, kind, i = _parse(s)
    if y is None and kind != "F":
        return (f"yours waits at slot {at} before {_spell(s)}: only a forward waits (for the"
                f" stage before's forward of the same microbatch); stock never delays a"
                f" {KINDS[kind]}")
    if y is None and stage == 0:
        return (f"yours waits at slot {at} before {_spell(s)}: stage 0's forwards never wait,"
                f" their input is the batch")
    if y is None:
        return (f"yours waits at slot {at} before {_spell(s)}, which stock runs there: its"
                f" input, {stage - 1}F{i}, ran in slot {_slot(stock_all, f'{stage - 1}F{i}')},"
                f" an earlier one, so it is there")
    return (f"yours runs {_spell(y)} at slot {at}, stock's {_spell(s)}: each slot takes the"
            f" rank's next entry, in its list's order")


def _pointed(given, out):
    """The list's entry each slot of `out` looked at (a slot that waits looks at a forward)."""
    at, pointed = 0, []
    for a in out:
        b = given[at] if at < len(given) else None
        pointed.append(b)
        at += a == b  # copied (an action, or the list's own None); else a wait
    return pointed


def _microbatches(n):
    return f"{n} microbatch{'es' * (n != 1)}"


CHECKS = {"interleaved": interleaved, "zero_bubble": zero_bubble}
