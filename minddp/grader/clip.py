"""The grader's check of gradient clipping on a mesh (minddp/mesh/clip.py).

    minddp grade exercises/clip.py            # grade.py runs CHECKS["clip"] on every rank

A small GPT (examples/gpt_nd.py's) is parallelized on each mesh of the world size twice:
with minddp's calls, where the student's clip_grad_norm_ runs (its weight_norms reads
minddp's TP slices), and with stock's (fully_shard, parallelize_module, DDP, the pipeline),
where torchtitan's clip runs as references/libraries.py writes it on stock's calls. One
forward and backward each (the gradients before clipping are the same bits: the capstone
shows it); then both clip, with a max_norm the norm exceeds (every gradient scaled) and one
it does not (the scale clamped to 1). Graded bit for bit: the total norm, the same on every
rank, and every rank's local gradient after. A total that is not stock's is compared with
the totals of the usual mistakes, each computed here in float64 (a copy summed over the
group that holds it, a part not summed, a square or a square root missed, the stages not
summed over pp), and the one it matches is named. As in pieces.py: each check returns the
same results on every rank.
"""

import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..bench.transformer import gpt
from ..mesh.compose import parallelize, pipeline
from ..references.libraries import LIBRARIES, stock_clip_grad_norm_
from ..tp.plan import SLICES
from .training import _everyone, _ranks, _result

# world size -> the meshes graded: (dimensions, sizes, dp's kind); a pipeline needs an
# untied output layer. dp=2 with DDP: every gradient a copy over dp.
MESHES = {2: [(("dp",), (2,), "fsdp"), (("dp",), (2,), "ddp"), (("tp",), (2,), "fsdp"),
              (("pp",), (2,), "fsdp")],
          4: [(("dp", "tp"), (2, 2), "fsdp"), (("pp", "dp"), (2, 2), "fsdp"),
              (("pp", "tp"), (2, 2), "fsdp"), (("dp",), (4,), "ddp")]}
MAX_NORMS = (0.1, 100.0)  # the norm (about 1.5) exceeds the first, not the second
SIZES = dict(vocab=32, d=16, heads=4, tokens=8)


def _label(names, shape, dp):
    mesh = ",".join(f"{n}={s}" for n, s in zip(names, shape))
    return mesh + (" (DDP)" if dp == "ddp" else " (fully_shard)" if "dp" in names else "")


def _build(lib, names, shape, dp):
    """(model, stage, mesh) with one step's gradients: examples/gpt_nd.py's first step."""
    mesh = lib.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pp = "pp" in names
    torch.manual_seed(0)
    model = gpt(**SIZES, blocks=2, tied=not pp)
    stage = parallelize(model, mesh, lib, dp)
    coordinate = dict(zip(names, mesh.get_coordinate()))
    g = torch.Generator().manual_seed(coordinate.get("dp", 0))
    tokens = torch.randint(0, SIZES["vocab"], (4, SIZES["tokens"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if pp:
        first, last = coordinate["pp"] == 0, coordinate["pp"] == mesh["pp"].size() - 1
        schedule = pipeline(stage, mesh, lib, loss_fn, 2)
        schedule.step(*([x] if first else []), target=y if last else None,
                      losses=[] if last else None)
    else:
        loss_fn(stage(x), y).backward()
    return model, stage, mesh


def _local(t):
    return None if t is None else (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _grads(model):
    return {n: _local(p.grad) for n, p in model.named_parameters()}


def _clipped(clip, model, stage, mesh, saved):
    """{max_norm: (total, {name: local gradient after})}, the gradients put back between."""
    seen = {}
    for max_norm in MAX_NORMS:
        _put_back(model, saved)
        total = clip(stage, max_norm, mesh)
        seen[max_norm] = (total, _grads(model))
    return seen


def _put_back(model, saved):
    for p, g in zip(model.parameters(), saved):
        p.grad = None if g is None else g.clone()


def clip(student, rank, world_size):
    """Per mesh: the student's clip_grad_norm_ on minddp's composition against torchtitan's
    clip on stock's, both max_norms: the total norm and every local gradient, bit for bit."""
    # stock's DTensor warns, on every rank, of a norm reduced over dp and tp in two steps
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = []
    for names, shape, dp in MESHES[world_size]:
        label = _label(names, shape, dp)
        before, theirs = _stock(world_size, names, shape, dp)
        model, stage, mesh = _build(LIBRARIES["manual"], names, shape, dp)
        ours_before = _grads(model)
        assert all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                   for a, b in zip(ours_before.values(), before.values())), \
            f"{label}: minddp's gradients before clipping are not stock's: the grader's fault"
        saved = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        yours = _clipped(student.clip_grad_norm_, model, stage, mesh, saved)

        def hypotheses():  # (a collective: called on every rank alike, by _verdict)
            _put_back(model, saved)  # the gradients before clipping
            # each rank's own mistakes' totals: a part not summed is this rank's part alone
            return _everyone(_hypotheses(model, mesh, names, dp))
        everyone = _everyone({m: _compared(yours[m], theirs[m], before, m) for m in MAX_NORMS})
        results.append(_result(
            f"{_ranks(world_size)}, {label}: the total norm and every gradient, max_norm"
            f" {MAX_NORMS[0]} and {MAX_NORMS[1]}", *_verdict(everyone, hypotheses)))
    return results


_STOCK = {}  # (group, mesh): stock's gradients before and after: one process grades many files


def _stock(world_size, names, shape, dp):
    """(gradients before clipping, {max_norm: (total, gradients after)}) of stock's model and
    torchtitan's clip on this mesh; kept for the next file graded in this process (the tests
    grade every planted mistake on one set of ranks), plain tensors only: no mesh is kept."""
    key = (id(dist.group.WORLD), world_size, names, shape, dp)
    if key not in _STOCK:
        model, stage, mesh = _build(LIBRARIES["stock"], names, shape, dp)
        before = _grads(model)
        saved = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        theirs = _clipped(stock_clip_grad_norm_, model, stage, mesh, saved)
        _STOCK[key] = before, {m: (_local(total), grads) for m, (total, grads) in theirs.items()}
    return _STOCK[key]


def _compared(yours, theirs, before, max_norm):
    """This rank's differences at one max_norm: the totals, the first gradient unlike stock's
    and the factor it was scaled by (against the gradient before clipping)."""
    (total, grads), (stock_total, stock_grads) = yours, theirs
    total = torch.as_tensor(total).detach().double().item() if total is not None else None
    first = next((n for n, g in grads.items() if (g is None) != (stock_grads[n] is None) or (
        g is not None and not torch.equal(g, stock_grads[n]))), None)
    record = {"max_norm": max_norm, "total": total, "stock": stock_total.item()}
    if first is not None:
        g, s, b = grads[first], stock_grads[first], before[first]
        record["first"] = first
        if g is not None and s is not None and g.shape == s.shape:
            at = tuple(int(i) for i in (g != s).nonzero()[0])
            record.update(at=at, yours=g[at].item(), theirs=s[at].item(), before=b[at].item())
            # The factor the student's gradient was scaled by, if it is one of these: each
            # tried as stock multiplies (the gradient times a float32 scalar tensor).
            coef = max_norm / (stock_total + 1e-6)
            factors = {"stock's": coef.clamp(max=1.0), "not clamped": coef,
                       "no 1e-6": (max_norm / stock_total).clamp(max=1.0),
                       "not scaled": torch.ones(()),
                       "inverted": stock_total / max_norm}
            record["factor"] = next((k for k, f in factors.items() if torch.equal(b * f, g)),
                                    None)
            record["coef"] = coef.item()
    return record


def _hypotheses(model, mesh, names, dp):
    """{what the student did: the total it gives}, each in float64 on this rank, the same
    on every rank: the right total, and each usual mistake's."""
    def whole(n, group, square=True, root=True):
        n = n ** 2 if square else n.clone()
        dist.all_reduce(n, group=group)
        return n ** 0.5 if root else n

    def total(copies_dp=False, copies_tp=(), parts_dp=True, parts_tp=True, stages=True,
              square=True, root=True):
        squares, seen = torch.zeros((), dtype=torch.float64), set()
        for layer in model.modules():
            for attr, p in layer.named_parameters(recurse=False):
                if p.grad is None or id(p) in seen:
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
        found["parts' squares not rooted"] = total(root=False)
    found["sqrt missed"] = found["right"] ** 2
    found["norms summed"] = _sum_of_norms(model)
    if "pp" in names:
        dist.all_reduce(found["norms summed"], group=mesh["pp"].get_group())
    return {k: v.item() for k, v in found.items()}


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
    "parts' squares not rooted": "the sqrt missed: the parts' squares were added over the"
    " group but the square root of the sum not taken, so that sum counts as a norm",
    "sqrt missed": "the sqrt missed: yours is stock's total squared; the norm is the square"
    " root of the sum of squares",
    "norms summed": "the squares not taken: the weights' norms were added, not their squares"
    " (the total is sqrt of the sum of every weight's squared norm)",
}


def _verdict(everyone, hypotheses):
    """passed, where, diagnosis: the first rank and max_norm that differs, read as a mistake
    with that rank's totals of the usual mistakes: hypotheses()[rank], every rank's. They
    cost some all_reduces per weight, so they are computed only for a total not stock's."""
    for rank, record in enumerate(everyone):
        for max_norm, r in record.items():
            if r["total"] != r["stock"]:
                where = (f"rank {rank}, max_norm {max_norm}: the total norm: yours"
                         f" {r['total']!r}, stock's {r['stock']!r}")
                exact = None if r["total"] is None else hypotheses()[rank]
                return False, where, _total_why(r["total"], exact)
            if "first" in r:
                where = (f"rank {rank}, max_norm {max_norm}, {r['first']}"
                         + (f", element {r['at']}: yours {r['yours']!r}, stock's"
                            f" {r['theirs']!r} (before clipping {r['before']!r})"
                            if "at" in r else ": a gradient where stock has none, or none"
                            " where stock has one"))
                return False, where, _scale_why(r)
    return True, "", ""


def _total_why(total, exact):
    if total is None:
        return "no total returned: clip_grad_norm_ returns the total norm (before clipping)"
    if math.isclose(total, exact["right"], rel_tol=1e-5):
        return ("the right total within rounding, not stock's bits: stock takes each weight's"
                " norm (torch.linalg.vector_norm), reduces it over dp, then over tp (sum of"
                " squares, then sqrt, each), joins the norms of a mesh (vector_norm of the"
                " stacked norms), the meshes' totals (sum of squares, then sqrt), then pp")
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
    return (f"not the gradient before clipping times stock's scale, max_norm / (total + 1e-6)"
            f" clamped to 1 = {min(coef, 1.0):.6g}, nor a usual mistake's scale")


CHECKS = {"clip": clip}
