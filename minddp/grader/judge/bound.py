"""Right, but not stock's bits: an averaged gradient judged against its exact value.

    minddp grade exercises/naive.py --ranks 3     # "correct", with what differs from stock

Data parallelism's gradient is (1/W) sum_r g_r: W float32 numbers added in some order and
scaled once. Every order and either scaling (x / W, or x * (1/W) as stock does) is right,
and each rounds differently: bits cannot tell a right average from stock's. So a gradient
that is not stock's bit for bit is judged against the exact average instead (the same
ranks' gradients, summed in float64), within a bound that holds for any order. Added in
float32 in any order, W terms carry an error of at most gamma(W-1) sum_r |g_r / W| (gamma(k)
= k u / (1 - k u), u = 2^-24: Higham, "Accuracy and Stability of Numerical Algorithms",
4.2); scaling each term first adds 2u of each, scaling the sum last u of it. So

    |yours - exact| <= (W + 2) u sum_r |g_r| / W    for every element (ddp_units(W) = W + 2).

Each step is judged from the student's own weights: every rank computes its local gradient
on a plain copy of its model before the step, so one rounding difference in step 0 does not
become a failure in step 2. A DDP also keeps its replicas equal: every rank's gradient and
weights the same. Within the bound, equal on every rank, at every step: correct. What
differs from stock is named by trying the usual right ways on the same gradients.

The same two bounds judge the other exercises whose right answer may round apart from
stock's: any_order() a sum of the ranks' values in any order (the ring's blocks: gamma(W-1)
sum |x_r|), norm_allowed() a 2-norm summed in any order (clip's total); gamma() is Higham's
factor for k roundings in a row (a scale computed as a Python float, or in float32 tensors).
"""

import numpy as np
import torch
import torch.distributed as dist

from ...launch.groups import global_rank

U = 2.0 ** -24  # float32's unit roundoff
# bfloat16's: its adds are computed in float32, then rounded to bfloat16 (two roundings)
BF16_U = 2.0 ** -8 + 2.0 ** -24


def gamma(k, u=U):
    """Higham's gamma(k) = k u / (1 - k u): k roundings in a row, each a factor (1 + d) with
    |d| <= u, are together a factor (1 + t) with |t| <= gamma(k) (Higham, 3.1)."""
    return k * u / (1 - k * u)


def any_order(terms, u=U):
    """(exact, allowed): the exact sum of `terms` (one term a row: n of them, added row by
    row, in float64) and how far any order of adding them in a float of unit roundoff u
    may land from it, elementwise: gamma(n - 1) sum|x| (Higham, 4.2)."""
    parts = np.asarray(terms, dtype=np.float64)
    return parts.sum(0), gamma(len(parts) - 1, u) * np.abs(parts).sum(0)


def norm_allowed(elements, roots=6, u=U):
    """The relative error a 2-norm of `elements` numbers computed in float32 may carry, in
    any order: the squares (1 rounding each), summed in any tree (gamma(elements - 1) for
    positive terms, whatever the order: the all_reduces, the stacks and the joins are nodes
    of it), a square root taken and squared again on the way `roots` times (3 roundings
    each: a weight's norm made whole over dp, then tp, stacked, joined, summed over pp);
    so the sum is S (1 + t), |t| <= g = gamma(elements + 3 roots), and its root
    sqrt(S) (1 + t') (1 + d): |t'| <= g / (2 - g), |d| <= u."""
    g = gamma(elements + 3 * roots, u)
    return (1 + u) * (1 + g / (2 - g)) - 1


def ddp_units(world_size):
    """The units of u sum|g_r| / W a right average may be off: W - 1 for the sum in any order
    (any_order's gamma), 2 for a scale before it (x / W of each term), or 1 after it."""
    return (world_size - 1) + 3


def local_gradients(plain, module, microbatches, loss_fn):
    """{name: this rank's own gradient}, its microbatches' added, from a plain copy of
    `module`'s weights now."""
    # (a sharded module's weights are DTensors: each made whole, on every rank alike)
    plain.load_state_dict({name: t.full_tensor() if hasattr(t, "full_tensor") else t
                           for name, t in module.state_dict().items()})
    plain.zero_grad()
    for x, y in microbatches:
        loss_fn(plain(x), y).backward()
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in plain.named_parameters()}


def right_ways(grads, world_size, group=None):
    """Collective: {way: {name: the averaged gradient}} for the usual right ways, each one
    all_reduce per parameter: what a student's result is recognised as."""
    ways = {"x / W": {}, "sum / W": {}, "x * (1/W)": {}}
    for name, g in grads.items():
        if g is None:
            continue
        for way, before, after in (("x / W", g / world_size, None),
                                   ("sum / W", g.clone(), world_size),
                                   ("x * (1/W)", g * (1.0 / world_size), None)):
            dist.all_reduce(before, group=group)
            ways[way][name] = (before if after is None else before / after).numpy()
    return ways


def right_ways_of(local, group=None):
    """Collective, on every rank: [each step's right_ways] for a run whose local gradients on
    this rank were `local` ([each step's {name: array}]; None on a rank outside `group`).

    Called only for a gradient a rounding apart from stock's: the ways cost 3 all_reduces per
    parameter and step, and most runs are stock's bits, which need none. Every rank decides
    alike (from what all gathered), so all of them call it or none. A rank outside `group`
    is sent the group's ways by its first rank.
    """
    ways = None
    if local is not None:
        size = dist.get_world_size(group)
        ways = [right_ways({n: None if g is None else torch.from_numpy(g)
                            for n, g in grads.items()}, size, group) for grads in local]
    if group is not None:
        box = [ways]
        dist.broadcast_object_list(box, src=global_rank(group, 0))
        ways = box[0]
    return ways


NOTES = {  # DDP's: stock scales each rank's gradient by 1/W, then all-reduces buckets
    "x / W": "you divide each gradient by the world size (x / W); stock multiplies by 1/W (x *"
             " (1/W)), and the two round differently: multiply by 1.0 / world_size for stock's"
             " bits",
    "sum / W": "you sum, then divide; stock scales each rank's gradient by 1/W before the sum:"
               " scale first for stock's bits",
    "x * (1/W)": "stock's arithmetic, one all_reduce per parameter: stock all-reduces buckets"
                 " of many, and gloo adds the ranks in an order set by where an element sits"
                 " in the buffer",
}


FSDP_NOTES = {  # stock's fully_shard: one reduce_scatter(AVG) of a flat buffer per unit
    "x / W": "you divide each rank's gradient by the world size before the sum; stock's"
             " reduce_scatter with AVG sums, then divides (gloo): reduce with AVG for stock's"
             " bits",
    "sum / W": "stock's arithmetic (sum, then divide), but not its buffer: stock"
               " reduce_scatters one flat buffer of the unit's gradients, laid out as"
               " unshard's, and gloo adds the ranks in an order set by where an element sits"
               " in the buffer: one flat buffer for stock's bits",
    "x * (1/W)": "you multiply each rank's gradient by 1/W before the sum; stock's"
                 " reduce_scatter with AVG sums, then divides (gloo): reduce with AVG for"
                 " stock's bits",
}


def judge(yours, locals_, ways, world_size, notes=NOTES):
    """(correct, where, what): yours[step][rank] and locals_[step][rank] as gathered from
    every rank, ways[step] (right_ways_of); `notes` names what differs from stock, by way."""
    units_seen, matched = 0.0, set(notes)
    for step, (mine, theirs) in enumerate(zip(yours, locals_)):
        for name in mine[0]:
            if mine[0][name] is None:
                continue
            parts = np.stack([t[name] for t in theirs]).astype(np.float64)
            exact = parts.sum(0) / world_size
            scale = np.abs(parts).sum(0) / world_size
            for rank in range(world_size):
                got = mine[rank][name]
                if not np.array_equal(got, mine[0][name]):
                    return (False, f"step {step}, rank {rank}, {name}",
                            f"rank {rank}'s gradient is not rank 0's: the replicas part")
                gap = np.abs(got.astype(np.float64) - exact)
                units = float((gap / np.maximum(U * scale, np.finfo(np.float64).tiny)).max())
                units_seen = max(units_seen, units)
                if units > ddp_units(world_size):
                    return (False, f"step {step}, rank {rank}, {name}",
                            f"{units:.3g} units of u x sum|g_r|/W from the exact average, where"
                            f" any order of the sum stays within {ddp_units(world_size)}: a wrong"
                            f" gradient, not a different order")
            matched &= {w for w in notes if np.array_equal(mine[0][name], ways[step][w][name])}
    way = next(iter(sorted(matched)), None)
    what = notes[way] if way else ("another rounding than stock's: another order of the sum,"
                                    " or the 1/W in another place (before or after the sum,"
                                    " a divide or a multiply), in buffers that no one"
                                    " all_reduce per parameter reproduces")
    return True, "", (f"correct, not stock's bits: within {units_seen:.2g} of the"
                      f" {ddp_units(world_size)}"
                      f" units any order allows, the same on every rank, at every step; {what}")
