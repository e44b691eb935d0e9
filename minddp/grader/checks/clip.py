"""The grader's check of gradient clipping on a mesh (minddp/mesh/clip.py).

    minddp grade exercises/clip.py            # grade.py runs CHECKS["clip"] on every rank

A small GPT (examples/gpt_nd.py's) is parallelized on each mesh of the world size twice:
with minddp's calls, where the student's clip_grad_norm_ runs (its weight_norms reads
minddp's TP slices), and with stock's (fully_shard, parallelize_module, DDP, the pipeline),
where torchtitan's clip runs as references/libraries.py writes it on stock's calls. One
forward and backward each (the gradients before clipping are the same bits: the capstone
shows it); then both clip, with a max_norm the norm exceeds (every gradient scaled) and one
it does not (the scale clamped to 1). Graded bit for bit: the total norm, the same on every
rank, and every rank's local gradient after. A total or a gradient that is not stock's is
read as one of the usual mistakes (clip_verdict.py). As every check: it returns the same
results on every rank.
"""

import logging

import numpy as np

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...bench.transformer import gpt
from ...mesh.compose import parallelize, pipeline
from ...references.libraries import LIBRARIES, stock_clip_grad_norm_
from ..judge.bound import U
from ..shared.training import _everyone, _ranks, _result
from .clip_verdict import _hypotheses, _local, _verdict


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
        # every gradient element of the whole model (a tied weight once): the norm's terms
        elements = sum(p.numel() for p in gpt(**SIZES, blocks=2, tied="pp" not in names)
                       .parameters())
        results.append(_result(
            f"{_ranks(world_size)}, {label}: the total norm and every gradient, max_norm"
            f" {MAX_NORMS[0]} and {MAX_NORMS[1]}", *_verdict(everyone, hypotheses, elements)))
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
        if total is not None:
            record.update(_scaled(grads, before, max_norm, total))
    return record


def _scaled(grads, before, max_norm, total):
    """How the gradients after compare with each one before times the exact scale of your
    total, min(max_norm / (total + 1e-6), 1) (in float64): the most units of u (of each
    product) any is off ("units"), and whether each is the one before times that scale
    computed as a Python float (float64), rounded once at the multiply ("python float"), or
    by stock's arithmetic on your total ("stock's on yours")."""
    scale = min(max_norm / (total + 1e-6), 1.0)
    # stock's own arithmetic on your total (a total a rounding apart scales apart too)
    formula = torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6),
                          max=1.0)
    units, python, as_stock = 0.0, True, True
    for name, g in grads.items():
        b = before[name]
        if g is None and b is None:
            continue  # (another stage's weight)
        if g is None or b is None or g.shape != b.shape:
            return {"units": float("inf"), "python float": False}
        exact = b.double() * scale
        gap = (g.double() - exact).abs()
        size = U * exact.abs()
        if bool((gap[size == 0] > 0).any()):
            return {"units": float("inf"), "python float": False}
        units = max(units, float((gap[size > 0] / size[size > 0]).max()) if (size > 0).any()
                    else 0.0)
        python &= torch.equal(g, b * scale)
        as_stock &= torch.equal(g, b * formula)
    theirs = float(formula)
    ulps = abs(float(np.float32(scale)) - theirs) / float(np.spacing(np.float32(theirs)))
    return {"units": units, "python float": python and not as_stock, "ulps": ulps,
            "stock's on yours": as_stock}
