"""Recomputation's check: checkpoint against torch.utils.checkpoint (non-reentrant).

    minddp grade exercises/recompute.py       # grade.py runs CHECKS["recompute"] on every rank

Full and selective, with dropout and without, three small models (recompute_runs.py): the
loss, every gradient, the random state after backward, and the bytes kept from the forward
for backward; and an argument changed in place after the forward, which stock refuses. The
cases are shared out over the ranks, then gathered: as every check, the same results on
every rank.
"""

import functools
import gc

import torch
from torch.utils.checkpoint import checkpoint as stock_checkpoint

from ..shared.training import _everyone, _ranks, _result
from .recompute_runs import MODELS, _case_label, _recompute_cases, _reference, _run


def recompute(student, rank, world_size):
    """The student's checkpoint against torch.utils.checkpoint's (non-reentrant): every case,
    shared out over the ranks, then gathered."""
    from ...memory.recompute import MATMULS
    save_ops = getattr(student, "MATMULS", MATMULS)
    cases = _recompute_cases()
    mine = range(rank, len(cases), world_size)
    # (counted once here: gc.get_freeze_count() walks every object set aside, 30 ms in a warm
    # rank, and only _run's own freeze, undone each time, changes it meanwhile)
    frozen = gc.get_freeze_count() > 0
    # Stock's runs and the plain ones first, before any of the student's code runs here.
    seen = {i: {how: _reference(cases[i], how, save_ops, frozen) for how in ("stock", "none")}
            for i in mine}
    for i in mine:
        try:
            seen[i]["yours"] = _run(cases[i], student.checkpoint, save_ops, frozen)
        except Exception as error:  # noqa: BLE001 (said as the case's verdict)
            if isinstance(error, NotImplementedError):
                raise  # (a TODO left: the grader says "not written yet")
            seen[i]["yours"] = f"{type(error).__name__}: {error}"
    merged = {}
    for part in _everyone(seen):
        merged.update(part)
    verdicts = [_recompute_verdict(case, merged[i]) for i, case in enumerate(cases)]
    results = []
    for policy in ("full", "selective"):
        mine = [(case, verdict) for case, verdict in zip(cases, verdicts)
                if case["policy"] == policy]
        failed = next(((case, v) for case, v in mine if v is not None), None)
        label = (f"{_ranks(world_size)}, {policy}: 3 models, with dropout and without, under"
                 f" autocast, preserve_rng_state=False")
        if failed is None:
            results.append(_result(label, True))
            continue
        case, (where, why) = failed
        results.append(_result(label, False, f"{_case_label(case)}: {where}",
                               _recompute_why(case, why, cases, verdicts)))
    results.append(_refuses_an_argument_changed(student, world_size))
    return results


def _refuses_an_argument_changed(student, world_size):
    """An argument changed in place between the forward and the backward: stock's refuses
    (autograd's version check), for the second forward would run on other numbers."""
    label = f"{_ranks(world_size)}, an argument changed in place after the forward"
    refused = []
    for how in (functools.partial(stock_checkpoint, use_reentrant=False), student.checkpoint):
        torch.manual_seed(0)
        model, x = MODELS["a residual MLP"][0](0.0), torch.randn(6, 8)
        try:
            y = how(model, x)
        except Exception as error:  # noqa: BLE001 (a forward that raises: said by the cases
            if isinstance(error, NotImplementedError):  # above; a TODO: "not written yet")
                raise
            return _result(label, False, "checkpoint(model, x)", f"the forward raised:"
                           f" {type(error).__name__}: {error}")
        x.add_(1.0)
        try:
            y.square().mean().backward()
            refused.append(False)
        except RuntimeError:
            refused.append(True)
    if refused == [True, True]:
        return _result(label, True)
    return _result(label, False, "x.add_(1.0) between checkpoint(model, x) and backward",
                   "the argument changed in place, and yours ran the second forward on the new"
                   " numbers: stock's refuses (the version counter moved); note each tensor"
                   " argument's _version at the forward, and raise in the recompute if one"
                   " moved" if refused[0] else "stock's did not refuse: the grader's case is"
                   " wrong here")


def _recompute_verdict(case, runs):
    """None, or (where, what) for the first thing that differs from stock's."""
    yours, stock, none = runs["yours"], runs["stock"], runs["none"]
    if isinstance(yours, str):
        return "the run", ("raised", yours)
    for name, want in stock.items():
        if name in ("rng", "kept", "again"):
            continue
        got = yours[name]
        if got is None or want is None:
            if (got is None) != (want is None):
                return name, ("presence", name)
            continue
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name}: yours {got.dtype} {tuple(got.shape)}, stock's {want.dtype}" \
                   f" {tuple(want.shape)}", ("value", name)
        if not torch.equal(got, want):
            at = tuple(int(i) for i in (got != want).nonzero()[0])
            return (f"{name}, element {at}: yours {float(got[at]):.6g}, stock's"
                    f" {float(want[at]):.6g}", ("value", name))
    if not torch.equal(yours["rng"], stock["rng"]):
        return "the random state after backward", ("rng", None)
    if yours["kept"] != stock["kept"]:
        return (f"bytes kept from the forward for backward: yours {yours['kept']}, stock's"
                f" {stock['kept']} (without checkpointing {none['kept']})",
                ("kept", (yours["kept"], stock["kept"], none["kept"])))
    if case["policy"] == "selective" and yours["again"] > stock["again"]:
        return (f"the matmuls and attention run in backward: yours {yours['again']}, stock's"
                f" {stock['again']}", ("again", None))
    return None


def _twin(case, cases, verdicts, **change):
    other = {**case, **change}
    return next((v for c, v in zip(cases, verdicts) if c == other), "none")


def _recompute_why(case, why, cases, verdicts):
    kind, what = why
    if kind == "kept":
        yours, stock, none = what
        if yours >= none:
            return (f"nothing dropped: yours keeps {yours} bytes for backward, as much as no"
                    f" checkpointing ({none}); stock's keeps {stock}. Keep only the arguments:"
                    f" each tensor an op saves packed as its number, got back by running the"
                    f" forward again in backward")
        if case["policy"] == "selective" and yours < stock:
            return (f"selective keeps less than stock's ({yours} bytes, stock's {stock}):"
                    f" the outputs of save_ops were not kept in the forward (Keep) and handed"
                    f" back in the second (Reuse): the matmuls run again")
        return f"yours keeps {yours} bytes for backward, stock's {stock}"
    if kind == "again":
        return ("selective runs the ops of save_ops again in backward: their outputs, kept in"
                " the forward (Keep), must be handed back in the second forward instead"
                " (Reuse), or selective costs what full does")
    if kind == "rng":
        return ("every gradient is stock's, but not the random state after backward"
                + (": the second forward left it where set_rng_state and its own draws put"
                   " it; stock's puts it back as it was when backward asked (the second"
                   " forward inside torch.random.fork_rng)"
                   if case["preserve"] else ": with preserve_rng_state=False stock stashes no"
                   " state and leaves the RNG where the second forward's draws left it"))
    plain = _twin(case, cases, verdicts, dropout=0.0, autocast=False, preserve=True)
    if not case["preserve"] and _twin(case, cases, verdicts, preserve=True) is None:
        return ("with preserve_rng_state=False stock stashes no random state: the second"
                " forward draws new dropout masks from the RNG as it stands (stock's flag,"
                " stock's meaning)")
    if case["autocast"] and _twin(case, cases, verdicts, autocast=False) is None:
        return ("under autocast only: the second forward did not run under the first one's"
                " autocast (enabled, dtype), so its ops saved tensors of another precision:"
                " put the autocast state back" + (f" (it raised: {what})" if kind == "raised"
                                                   else ""))
    if case["dropout"] and plain is None:
        return ("only where dropout draws: the second forward drew other masks than the"
                " first: the random state was not replayed (torch.get_rng_state() before the"
                " forward, torch.set_rng_state() before running it again)"
                + (f"; it raised: {what}" if kind == "raised" else ""))
    if kind == "raised":
        return f"an exception in this case: {what}"
    if kind == "presence":
        return f"{what}: a gradient on one side only"
    return (f"the first that differs is {what}: the tensors the backward got back are not"
            f" those the first forward saved (each number answered by the tensor saved in"
            f" that order)" if what != "(the loss)" else
            "the loss differs: the forward itself is not the function's")
