"""What a student's implementation got wrong, read from its numbers beside stock's.

    minddp grade my_naive.py         # the grader (grade.py) prints these verdicts

A run is recorded as numpy arrays: per step and rank, each parameter's gradient (after the
implementation's synchronization) and weight, and each rank's weights before the first
step. compare() finds the first element that differs from stock's and names the likeliest
cause, in the order a student meets them:
  start      ranks start from different weights: rank 0's were never copied to the others
  presence   a gradient stock has and the student's does not (or the reverse)
  ranks      a gradient that differs between ranks where stock's is the same on every rank:
             the average was skipped
  factor     every differing gradient a constant times stock's: W (summed, not averaged),
             1/W (averaged twice), or another scale
  rounding   within 16 units of the last place: a different summation order
  optimizer  every gradient equal, the weights parting: the step itself
"""

import numpy as np

from ...tools.diff import constant_factor, partial_factor

ROUNDING_UNITS = 16  # more than this is a different number, not a different order


def first_difference(ours, theirs):
    """(name, index) of the first element where two {name: array} differ, (name, None) for a
    gradient one side lacks or a shape apart, else None. NaN equals NaN here."""
    for name, a in ours.items():
        b = theirs.get(name)
        if a is None or b is None or a.shape != b.shape:
            if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
                return name, None
            continue
        differ = (a != b) & ~(np.isnan(a) & np.isnan(b))
        if differ.any():
            return name, np.unravel_index(int(np.argmax(differ)), a.shape)
    return None


def _at(array, index):
    return "(no gradient)" if array is None else f"{float(array[index]):.6g}"


def compare(ours, stock, world_size, order_note="stock's order"):
    """(passed, where, diagnosis) for two runs: each {"start": [rank]{name: weights},
    "grads": [step][rank]{name: grad or None}, "weights": [step][rank]{name: weights}}."""
    for rank, start in enumerate(ours["start"]):
        hit = first_difference(start, ours["start"][0])
        if hit is not None and first_difference(stock["start"][rank], stock["start"][0]) is None:
            return (False, f"before step 0, rank {rank}, {hit[0]}",
                    "ranks start from different weights: rank 0's were never copied to the others"
                    " (stock broadcasts rank 0's parameters and buffers at construction)")
    for step, (ours_step, stock_step) in enumerate(zip(ours["grads"], stock["grads"])):
        for rank in range(world_size):  # every rank's presence before any rank's values
            mine, theirs = ours_step[rank], stock_step[rank]
            for name in mine:
                if (mine[name] is None) != (theirs[name] is None):
                    return (False, f"step {step}, rank {rank}, {name}",
                            "no gradient: its hook never ran or its gradient was dropped"
                            if mine[name] is None else "a gradient where stock has none (a"
                            " frozen or unused parameter must keep .grad None)")
        for rank in range(world_size):
            mine, theirs = ours_step[rank], stock_step[rank]
            hit = first_difference(mine, theirs)
            if hit is None:
                continue
            name, index = hit
            if index is None:  # shapes apart
                return (False, f"step {step}, rank {rank}, {name}",
                        f"the gradient's shape {mine[name].shape} is not stock's"
                        f" {theirs[name].shape}")
            where = (f"step {step}, rank {rank}, {name}, element {tuple(map(int, index))}:"
                     f" yours {_at(mine[name], index)}, stock's {_at(theirs[name], index)}")
            return False, where, _why_gradients(ours_step, stock_step, step, world_size, name,
                                                order_note)
    for step, (ours_step, stock_step) in enumerate(zip(ours["weights"], stock["weights"])):
        for rank in range(world_size):
            hit = first_difference(ours_step[rank], stock_step[rank])
            if hit is not None:
                return (False, f"weights after step {step}, rank {rank}, {hit[0]}",
                        "every gradient equal to stock's, the weights parting: the optimizer's"
                        " step itself (an update twice, or the step before the average?)")
    return True, "", ""


def _why_gradients(ours_step, stock_step, step, world_size, name, order_note):
    for rank in range(1, world_size):
        if (first_difference(ours_step[rank], ours_step[0]) is not None
                and first_difference(stock_step[rank], stock_step[0]) is None):
            return (f"rank {rank}'s gradients differ from rank 0's, where stock's are the same"
                    f" on every rank: the average was skipped (no all_reduce, or its result"
                    f" never copied back into .grad)")
    by_name = lambda step_grads: {n: np.stack([step_grads[r][n] for r in range(world_size)])[None]
                                  for n in step_grads[0] if step_grads[0][n] is not None}
    mine, theirs = by_name(ours_step), by_name(stock_step)
    factor = constant_factor(mine, theirs, 0)
    some = None if factor is not None else partial_factor(mine, theirs, 0)
    if factor is not None or some is not None:
        f = factor if factor is not None else some[0]
        which = "every gradient" if some is None else f"{len(some[1])} of {len(mine)} gradients"
        why = (f"summed, not averaged: divide by the world size, {world_size}"
               if abs(f - world_size) < 1e-3 else
               "averaged twice: divided by the world size once too often"
               if abs(f * world_size - 1) < 1e-3 else "a loss or an average scaled differently")
        return f"{f:.3f}x stock's, {which}: {why}"
    a, b = mine[name], theirs[name]
    unit = np.finfo(a.dtype).eps * max(float(np.abs(b).max()), np.finfo(a.dtype).tiny)
    gap = float(np.abs(a.astype(np.float64) - b).max()) / unit
    what = "value" if name.startswith("(") else "gradient"  # "(output)": not a parameter's
    if gap <= ROUNDING_UNITS:
        return (f"tiny: {gap:.1f} units of the last place, the size of a different summation"
                f" order, not of a wrong {what} ({order_note})")
    return f"{gap:.3g} units of the last place: a different {what}, not a different order"
