"""What a clip apart from stock's means: the usual mistakes' totals, and the verdict.

    minddp grade exercises/clip.py            # checks/clip.py reads every rank's record here

A total that is not stock's is compared with the totals of the usual mistakes, each computed
here in float64 on the gradients before clipping (a copy summed over the group that holds
it, a part not summed, a square or a square root missed, the stages not summed over pp), and
the one it matches is named; a gradient that is not stock's, by the scale it was multiplied
by.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...tp.plan import SLICES
from ..judge.bound import U, norm_allowed


def _local(t):
    return None if t is None else (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _hypotheses(model, mesh, names, dp):
    """{what the student did: the total it gives}, each in float64 on this rank, the same
    on every rank: the right total, and each usual mistake's."""
    def whole(n, group, square=True, root=True):
        n = n ** 2 if square else n.clone()
        dist.all_reduce(n, group=group)
        return n ** 0.5 if root else n

    def total(copies_dp=False, copies_tp=(), parts_dp=True, parts_tp=True, stages=True,
              square=True, root=True, twice=False):
        squares, seen = torch.zeros((), dtype=torch.float64), set()
        for layer in model.modules():
            for attr, p in layer.named_parameters(recurse=False):
                if p.grad is None or (id(p) in seen and not twice):
                    continue  # a tied weight once
                seen.add(id(p))
                n = torch.linalg.vector_norm(_local(p.grad).double())
                if "dp" in names and (parts_dp if dp == "fsdp" else copies_dp):
                    n = whole(n, mesh["dp"].get_group(), square, root)
                sliced = layer in SLICES and attr in SLICES[layer]
                copy_tp = "all" in copies_tp or ("tp layers" in copies_tp and layer in SLICES)
                if "tp" in names and (parts_tp if sliced else copy_tp):
                    n = whole(n, mesh["tp"].get_group(), square, root)
                squares += n ** 2
        if "pp" in names and stages:
            dist.all_reduce(squares, group=mesh["pp"].get_group())
        return squares ** 0.5
    found = {"right": total()}
    if "dp" in names and dp == "ddp":
        found["a copy counted over dp"] = total(copies_dp=True)
    if "dp" in names and dp == "fsdp":
        found["parts not summed over dp"] = total(parts_dp=False)
    if "tp" in names:
        found["a TP layer's copy counted over tp"] = total(copies_tp=("tp layers",))
        found["a copy counted over tp"] = total(copies_tp=("all",))
        found["parts not summed over tp"] = total(parts_tp=False)
    if "pp" in names:
        found["stages not summed"] = total(stages=False)
    if "dp" in names or "tp" in names:
        found["parts' norms summed"] = total(square=False)
        found["parts' norms added, no root"] = total(square=False, root=False)
        found["parts' squares not rooted"] = total(root=False)
    if _tied(model):
        found["a tied weight twice"] = total(twice=True)
    found["sqrt missed"] = found["right"] ** 2
    found["norms summed"] = _sum_of_norms(model)
    if "pp" in names:
        dist.all_reduce(found["norms summed"], group=mesh["pp"].get_group())
    return {k: v.item() for k, v in found.items()}


def _tied(model):
    """Whether a weight of `model` belongs to two of its layers (tied)."""
    owners = {}
    for layer in model.modules():
        for p in layer.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return any(n > 1 for n in owners.values())


def _sum_of_norms(model):
    """The total with no square taken anywhere: each weight's whole norm, added (a guess at
    the join: norms added, not their squares). Weights whole by full_tensor()."""
    norms = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            norms += torch.linalg.vector_norm(g.double())
    return norms


WHY = {
    "a copy counted over dp": "a copy counted dp times: each gradient is a replica over dp"
    " (DDP: the same numbers on every dp rank), summed over dp's group where it should be"
    " counted once",
    "a TP layer's copy counted over tp": "a copy counted tp times: the row split's bias is"
    " whole on every tp rank (the same numbers; RowwiseParallel adds it once, after the sum),"
    " yet its norm was summed over tp's group; only the attributes SLICES names are slices",
    "a copy counted over tp": "a copy counted tp times: a weight TP leaves whole (a LayerNorm,"
    " a row split's bias, the embedding) holds the same numbers on every tp rank, yet its"
    " norm was summed over tp's group",
    "parts not summed over dp": "a part not summed over dp: fully_shard's gradients are each"
    " rank's block of rows, their squares must be added over dp's group (all_reduce) before"
    " the norm is whole",
    "parts not summed over tp": "a part not summed over tp: a TP slice's norm is this rank's"
    " columns or rows only, its square must be added over tp's group",
    "stages not summed": "the stages not summed over pp: each pipeline stage holds its own"
    " weights; the stages' totals, squared, must be added over pp's group, then rooted",
    "parts' norms summed": "the squares not taken: the ranks' norms of their parts were added"
    " over the group, not their squares (sum of squares, then sqrt)",
    "parts' norms added, no root": "the squares not taken, and no root: the ranks' norms of"
    " their parts were added over the group as they are; make a part's norm whole as"
    " (sum of squares) ** 0.5: square it, all_reduce (SUM), then the square root",
    "a tied weight twice": "a tied weight counted twice: the embedding's weight is also the"
    " output layer's (one tensor, two layers), and module.modules() meets it in both; count"
    " each parameter once (a set of the ids seen)",
    "parts' squares not rooted": "the sqrt missed: the parts' squares were added over the"
    " group but the square root of the sum not taken, so that sum counts as a norm",
    "sqrt missed": "the sqrt missed: yours is stock's total squared; the norm is the square"
    " root of the sum of squares",
    "norms summed": "the squares not taken: the weights' norms were added, not their squares"
    " (the total is sqrt of the sum of every weight's squared norm)",
}


# A scale max_norm / (total + 1e-6), clamped, then each product: stock's rounds 4 times in
# float32 tensors (total + 1e-6, its reciprocal, max_norm cast and multiplied), the product
# once more; a Python float's twice (once to float32 at the multiply, the product): every
# right way is within gamma(6) of the exact product, gradient before x the exact scale.
SCALE_UNITS = 6


def _verdict(everyone, hypotheses, elements):
    """passed, where, diagnosis: stock's bits; correct: each total within norm_allowed() of
    the exact norm of the `elements` gradient numbers (the same on every rank) and every
    gradient the one before times the exact scale of that total within SCALE_UNITS (judge/
    bound.py); else the first rank and max_norm apart, read as a usual mistake with that
    rank's totals of them: hypotheses()[rank], every rank's. They cost some all_reduces per
    weight, so they are computed only for a total not stock's (every rank alike)."""
    exact, notes, first = None, [], ""
    for rank, record in enumerate(everyone):
        for max_norm, r in record.items():
            if r["total"] != r["stock"]:
                where = (f"rank {rank}, max_norm {max_norm}: the total norm: yours"
                         f" {r['total']!r}, stock's {r['stock']!r}")
                if exact is None and r["total"] is not None:
                    exact = hypotheses()
                right, note = _total_right(everyone, rank, max_norm, exact, elements)
                if not right:
                    return False, where, note
                notes.append(note)
                first = first or where
            if "first" in r:
                where = (f"rank {rank}, max_norm {max_norm}, {r['first']}"
                         + (f", element {r['at']}: yours {r['yours']!r}, stock's"
                            f" {r['theirs']!r} (before clipping {r['before']!r})"
                            if "at" in r else ": a gradient where stock has none, or none"
                            " where stock has one"))
                if r.get("units", float("inf")) > SCALE_UNITS:
                    return False, where, _scale_why(r)
                if not r["stock's on yours"]:  # (else: your total's, noted above)
                    notes.append(_scale_note(r))
                    first = first or where
    if not notes:
        return True, "", ""
    return True, first, "correct, not stock's bits: " + "; ".join(dict.fromkeys(notes))


def _total_right(everyone, rank, max_norm, exact, elements):
    """(right, the words): a total apart from stock's bits, judged against the exact norm."""
    total = everyone[rank][max_norm]["total"]
    if total is None:
        return False, _total_why(None, None)
    mine = exact[rank]
    gap, allowed = abs(total - mine["right"]), norm_allowed(elements) * mine["right"]
    nearer = [m for m, v in mine.items() if m != "right" and abs(total - v) < gap]
    if nearer:  # (a usual mistake's total, where not the right one, lies 5e-3 or more from it)
        return False, WHY[min(nearer, key=lambda m: abs(total - mine[m]))]
    if gap > allowed:
        return False, _total_why(total, mine)
    others = {r: e[max_norm]["total"] for r, e in enumerate(everyone)}
    if len(set(others.values())) > 1:
        each = ", ".join(f"rank {r}: {t!r}" for r, t in others.items())
        return False, (f"the ranks' totals differ ({each}): every rank must return the same"
                       f" total, or each scales its gradients by another factor")
    return True, (f"your total is {gap / mine['right'] / U:.3g} u of it from the exact norm,"
                  f" within the {allowed / mine['right'] / U:.0f} u any order of summing the"
                  f" {elements} gradient numbers' squares allows; stock's order: each weight's"
                  f" norm (torch.linalg.vector_norm), reduced over dp, then over tp (sum of"
                  f" squares, then sqrt, each), a mesh's norms joined by vector_norm of them"
                  f" stacked, the meshes' totals (sum of squares, then sqrt), then pp")


def _scale_note(r):
    if r.get("python float"):
        return (f"your scale is a Python float (float64, rounded to float32 once, at the"
                f" multiply): {r['ulps']:g} unit(s) of the last place from stock's float32"
                f" scale of the same total, max_norm * (1 / (total + 1e-6)) in float32 tensors"
                f" (clip_grads_with_norm_); every gradient is the one before times it")
    return (f"every gradient is the one before times max_norm / (total + 1e-6) clamped to 1,"
            f" within {r['units']:.2g} of the {SCALE_UNITS} units (of u) a scale computed"
            f" another way may round to, not stock's bits (clip_grads_with_norm_: the scale a"
            f" float32 tensor, each gradient multiplied by it)")


def _total_why(total, exact):
    if total is None:
        return "no total returned: clip_grad_norm_ returns the total norm (before clipping)"
    for mistake, value in exact.items():
        if mistake != "right" and math.isclose(total, value, rel_tol=1e-5):
            return WHY[mistake]
    return (f"not the norm of the whole model's gradient, nor a usual mistake's: yours is"
            f" {total / exact['right']:.4g}x the right total")


def _scale_why(r):
    coef, factor = r.get("coef"), r.get("factor")
    if factor == "not scaled":
        return (f"not scaled: the total exceeds max_norm, so every gradient is multiplied by"
                f" max_norm / (total + 1e-6) = {coef:.6g} (clip_grads_with_norm_ takes the"
                f" parameters: given the gradients, it scales their .grad, None, and nothing)")
    if factor == "not clamped":
        return (f"the scale not clamped to 1: max_norm / (total + 1e-6) = {coef:.6g} > 1"
                f" (the norm is below max_norm) must leave the gradients as they are; stock"
                f" clamps it (max=1.0)")
    if factor == "no 1e-6":
        return ("scaled by max_norm / total, not stock's max_norm / (total + 1e-6): a few"
                " units of the last place apart")
    if factor == "inverted":
        return "scaled by total / max_norm: the scale is max_norm / (total + 1e-6), clamped to 1"
    if factor == "stock's":
        return ("this gradient scaled twice or another one's scale: stock multiplies every"
                " gradient once by max_norm / (total + 1e-6), clamped to 1")
    if coef is None:
        return "a gradient where stock has none, or none where stock has one, or another shape"
    units = r.get("units", float("inf"))
    return (f"not the gradient before clipping times the scale of your total, max_norm /"
            f" (total + 1e-6) clamped to 1 (stock's: {min(coef, 1.0):.6g}), nor a usual"
            f" mistake's scale" + (f": {units:.3g} units (of u) from it, where a right scale,"
                                   f" however computed, stays within {SCALE_UNITS}"
                                   if units < float("inf") else ""))
