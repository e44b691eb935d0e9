"""Expert parallelism's verdict: the student's run against one process's, in the order it runs.

    minddp grade exercises/experts.py        # checks/experts.py reads every rank's record here

The splits first (experts_routing.py), then the rows each expert is given (step 0), each
rank's output, the input's gradient and every gradient before sync_gradients, every gradient
after it (the replicated weights' average, an expert's sum and divisor), and every weight
after the last step: the first that differs, and what it means.
"""

import numpy as np

from .experts_reference import NUM_EXPERTS, STEPS
from .experts_routing import _rows_why, _splits_verdict


def _factor(ours, theirs):
    """f when `ours` is f times `theirs`, element by element (to 1e-5), else None."""
    a, b = ours.astype(np.float64), theirs.astype(np.float64)
    keep = np.abs(b) > 1e-30
    if not keep.any():
        return None
    ratios = a[keep] / b[keep]
    factor = float(np.median(ratios))
    if abs(factor - 1) < 1e-5 or not np.all(np.abs(ratios - factor) <= 1e-5 * abs(factor)):
        return None
    return factor


# -- what a difference means -----------------------------------------------------------------


def _first(ours, theirs, names=None):
    """(name, index) of the first element of {name: array} apart, else None."""
    for name in names or ours:
        a, b = ours.get(name), theirs.get(name)
        if a is None or b is None or a.shape != b.shape:
            if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
                return name, None
            continue
        if (a != b).any():
            return name, np.unravel_index(int(np.argmax(a != b)), a.shape)
    return None


def _where(step, rank, name, index, ours, theirs):
    if index is None:
        return f"step {step}, rank {rank}, {name}: " + (
            "no gradient" if ours is None else f"shape {tuple(ours.shape)}, the reference's"
            f" {tuple(theirs.shape)}" if theirs is not None else "a gradient the reference"
            " has not")
    return (f"step {step}, rank {rank}, {name}, element {tuple(int(i) for i in index)}: yours"
            f" {float(ours[index]):.6g}, the reference's {float(theirs[index]):.6g}")


def _expert_of(name):
    """The expert's number in a parameter's name (experts.mlps.3.up.weight: 3), else None."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["experts", "mlps"] else None


def _verdict(everyone, world_size, dp):
    ep = world_size // dp
    if any("splits" in e for e in everyone):
        return _splits_verdict(everyone, world_size, dp)
    if any("raised" in e for e in everyone):
        rank = next(r for r, e in enumerate(everyone) if "raised" in e)
        step, said = everyone[rank]["raised"]
        right = all(e["output"] is not None and np.array_equal(
            e["output"], e["reference"]["steps"][step]["(output)"]) for e in everyone)
        return False, f"step {step}, rank {rank}: {said}", (
            ("the forward is right, the backward" if right else "the backward") +
            " returned a gradient of another number of rows than the rows it is for: the"
            " gradient of the rows that arrived must go back to the ranks they came from,"
            " the same all_to_all the other way (send and recv swapped)")
    # (3) the rows each expert was given, at step 0: the regroup
    for rank, e in enumerate(everyone):
        for expert, theirs in sorted(e["reference"]["rows"].items()):
            ours = e["yours"]["rows"].get(expert)
            if ours is not None and np.array_equal(ours, theirs):
                continue
            counts = e["reference"]["counts"]
            return False, f"step 0, rank {rank}, expert {expert}'s rows", _rows_why(
                expert, rank, ours, theirs, counts, rank // ep * ep, ep)
    for step in range(STEPS):
        for rank, e in enumerate(everyone):
            ours, theirs = e["yours"]["steps"][step], e["reference"]["steps"][step]
            for what in ("(output)",):
                hit = _first({what: ours[what]}, {what: theirs[what]})
                if hit:
                    return False, _where(step, rank, what, hit[1], ours[what], theirs[what]), (
                        "every expert was given the reference's rows in the reference's"
                        " order, but this rank's outputs are not its pairs': (5) the"
                        " experts' outputs go back to source order (the inverse of the"
                        " regroup's permutation), then home by the all_to_all the other way")
        for rank, e in enumerate(everyone):
            ours, theirs = e["yours"]["steps"][step], e["reference"]["steps"][step]
            what = "(the input's gradient)"
            hit = _first({what: ours[what]}, {what: theirs[what]})
            hit = hit or _first(ours["local"], theirs["local"])
            if hit:
                name, index = hit
                a = ours[name] if name == what else ours["local"].get(name)
                b = theirs[name] if name == what else theirs["local"].get(name)
                return False, _where(step, rank, name, index, a, b) + " (before sync_gradients)", (
                    "the forward is right, the backward is not: " + (
                        "this rank's expert gradients" if _expert_of(name) is not None else
                        "the router's gradient" if name == "router.weight" else
                        "the input's gradient") + " differ from one process's before any"
                    " sync: each row's gradient must go back to where the row came from, in"
                    " its order (_AllToAll.backward: the same all_to_all, send and recv"
                    " swapped)")
        hit = _sync_verdict(everyone, step, world_size, dp)
        if hit:
            return hit
    for rank, e in enumerate(everyone):
        hit = _first(e["yours"]["weights"], e["reference"]["weights"])
        if hit:
            name, index = hit
            return False, "after the last step, " + _where(
                STEPS - 1, rank, name, index, e["yours"]["weights"][name],
                e["reference"]["weights"][name])[len(f"step {STEPS - 1}, "):], (
                "every gradient is the reference's, the weights part: the optimizer step")
    return True, "", ""


def _sync_verdict(everyone, step, world_size, dp):
    """After sync_gradients: the replicated weights' average, an expert's sum and divisor."""
    for rank, e in enumerate(everyone):
        ours, theirs = e["yours"]["steps"][step]["grads"], e["reference"]["steps"][step]["grads"]
        hit = _first(ours, theirs)
        if hit is None:
            continue
        name, index = hit
        where = _where(step, rank, name, index, ours[name], theirs[name]) + \
            " (after sync_gradients)"
        expert = _expert_of(name)
        if expert is None:
            same = all(np.array_equal(o["yours"]["steps"][step]["grads"][name],
                                      ours[name]) for o in everyone)
            factor = _factor(ours[name], theirs[name])
            if not same:
                return False, where, (
                    f"the replicated weights' gradients ({name}) differ from rank to rank:"
                    f" not averaged over every rank (all_reduce over the world, then / W ="
                    f" {world_size}); one process's is the mean of all W ranks' parts")
            if factor is not None:
                return False, where, (
                    f"{factor:.3f}x the reference's, the replicated weights ({name}): their"
                    f" gradient is all_reduced over every rank, then divided by W ="
                    f" {world_size}")
            return False, where, f"the replicated weights' gradient ({name}) is not the" \
                f" mean over every rank's part: all_reduce over the world, / W"
        local = e["reference"]["steps"][step]["local"].get(name)
        factor = _factor(ours[name], theirs[name])
        holders = (f"the {dp} ranks that hold it (dp) only" if dp > 1 else
                   "no other rank (at dp = 1 each expert lives on one rank)")
        if factor is not None:
            # W / factor is what the student divided by: 1 (not divided), dp or ep (which
            # may be equal: dp = ep = 2 at 4 ranks, then both are named)
            by = world_size / factor
            named = [f"{what} = {n}" for what, n in (("dp", dp), ("ep", world_size // dp))
                     if n > 1 and abs(by - n) < 1e-6]
            why = (f"not divided by W = {world_size}" if abs(by - 1) < 1e-6 else
                   f"divided by {' or '.join(named)}, not W = {world_size}" if named else
                   f"divided by {by:g}, not W = {world_size}")
            return False, where, (
                f"{factor:.3f}x the reference's, expert {expert}'s gradient: {why}. An"
                f" expert's gradient is summed over {holders}, then divided by all W ="
                f" {world_size}: the loss is the mean of the W ranks' losses, and the"
                f" all_to_all's backward already brought every rank's tokens' part")
        if local is not None and _factor(ours[name], local) is not None:
            return False, where, (
                f"expert {expert}'s gradient is this rank's own part, scaled: not summed over"
                f" {holders} before the division by W = {world_size}")
        if _over_ep(everyone, step, rank, name, world_size, dp, ours[name]):
            return False, where, (
                f"expert {expert}'s gradient is summed over the ep ranks, which hold other"
                f" experts: each rank added its own expert's gradient at the same place. An"
                f" expert's gradient is summed over {holders}, then divided by W ="
                f" {world_size}")
        return False, where, (
            f"expert {expert}'s gradient is not the reference's: an expert's gradient is summed"
            f" over {holders} (never over the ep ranks: they hold other experts), then"
            f" divided by W = {world_size}")
    return None


def _over_ep(everyone, step, rank, name, world_size, dp, ours):
    """Whether `ours` is the sum over every rank (or the ep ranks) of the local gradients of
    the expert in the same slot (the k-th expert of each rank), / W: an all_reduce over a
    group whose ranks hold other experts."""
    ep = world_size // dp
    per_rank = NUM_EXPERTS // ep
    slot = _expert_of(name) % per_rank
    rest = ".".join(name.split(".")[3:])

    def local(q):
        e = q % ep * per_rank + slot
        return everyone[q]["yours"]["steps"][step]["local"][f"experts.mlps.{e}.{rest}"]
    for ranks in (range(world_size), range(rank // ep * ep, rank // ep * ep + ep)):
        total = sum(local(q).astype(np.float64) for q in ranks) / world_size
        if np.allclose(ours, total, rtol=1e-4, atol=1e-7):
            return True
    return False
