"""Zero bubble's check: add_bubbles against stock's pass, every slot of every rank.

    minddp grade exercises/zero_bubble.py    # grade.py runs CHECKS["zero_bubble"] on every rank

Against stock's ScheduleInterleavedZeroBubble, made on real stages (shared/pipeline_lists.py):
every slot, None included, from stock's own lists before its pass; then the same lists packed
(their None slots taken out) against stock's pass, _add_bubbles_to_actions, where many
forwards must wait. As every check: it runs on every rank and returns the same results on each.
"""

import sys
from collections import Counter

from torch.distributed.pipelining import ScheduleInterleavedZeroBubble  # before any group
from torch.distributed.pipelining.schedules import _Action

from ..shared.pipeline_lists import (KINDS, LOCAL, _microbatches, _parse, _spell, _stock,
                                     _strings, _unreadable, accepted)
from ..shared.training import _everyone, _ranks, _result


BUDGET = 200_000  # lines of the student's file, the smallest case (a right pass: 187-575)


def zero_bubble(student, rank, world_size):
    """add_bubbles(every rank's list, stages) against stock's ScheduleInterleavedZeroBubble:
    every slot, None included; then on the same lists packed (their None slots taken out)
    against stock's own pass, _add_bubbles_to_actions, where many forwards must wait. First
    the smallest case under a budget of lines: a pass that never ends is named there, in a
    fraction of a second, not at the grade's time limit."""
    endless = _endless(student, rank, world_size)
    if endless:
        return [_result(f"{_ranks(world_size)}, {LOCAL[0]} stages a rank, the zero-bubble"
                        f" lists: {_microbatches(accepted(world_size)[0])}, within"
                        f" {BUDGET:,} lines", False, *endless)]
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


class _Spent(Exception):
    """The budget of lines is used up (raised inside the student's frame by the tracer)."""


def _endless(student, rank, world_size):
    """(where, why) if add_bubbles runs past BUDGET lines of the student's file on the
    smallest case (the same lists on every rank: all decide alike, no collective), else None.
    A pure function: its lines are counted (sys.settrace, the student's frames only)."""
    n, local = accepted(world_size)[0], LOCAL[0]
    schedule = _stock(ScheduleInterleavedZeroBubble, rank, world_size, local, n)
    lists = [_strings(schedule._calculate_single_rank_operations(r)) for r in range(world_size)]
    file, spent, last = student.__file__, [0], {}

    def count(frame, event, arg):
        if event == "line":
            spent[0] += 1
            if spent[0] > BUDGET:
                last.update(line=frame.f_lineno, names=dict(frame.f_locals))
                raise _Spent
        return count
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: count if frame.f_code.co_filename == file else None)
    try:
        student.add_bubbles([list(lst) for lst in lists], local * world_size)
        return None
    except _Spent:
        pass
    except Exception:  # (raised again, at its line, by the cases below)
        return None
    finally:
        sys.settrace(previous)
    source = open(file).read().splitlines()[last["line"] - 1].strip()
    where = (f"{_microbatches(n)}: {BUDGET:,} lines of your file run, the last at line"
             f" {last['line']}: {source}")
    return where, (f"add_bubbles never returns: a right pass takes a few hundred lines here"
                   f" (a slot per action at most, each rank's next entry in it), yours"
                   f" {BUDGET:,} and on" + _waiting(lists, last["names"]))


def _waiting(lists, names):
    """What the pass waits for forever, read from its own variables where a list of new lists
    (one per rank, the slots placed so far) is among them."""
    made = next((v for v in names.values() if isinstance(v, list) and len(v) == len(lists)
                 and all(isinstance(x, list) for x in v)
                 and any(len(x) > 2 * len(given) for x, given in zip(v, lists))), None)
    for r, slots in enumerate(made or []):
        placed = [a for a in slots if a is not None]
        given = [a for a in lists[r] if a is not None]
        if len(slots) > 2 * len(lists[r]) and len(placed) < len(given):
            action = given[len(placed)]
            stage, kind, i = _parse(action)
            return (f": rank {r} waits forever before {_spell(action)}: "
                    + (f"only a forward waits, for the stage before's forward of the same"
                       f" microbatch; stock never delays a {kind} (an I, W or B of stage s"
                       f" that waits for stage s - 1's waits forever: the backwards run from"
                       f" the last stage down)" if kind != "F" else
                       f"its input, {stage - 1}F{i}, is never placed"))
    return (": a loop that never ends (the rank's next entry never taken, or a `while` that"
            " nothing makes false)")


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
