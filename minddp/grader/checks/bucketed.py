"""BucketedDDP's check: the student's buckets beside stock DDP's, step by step.

    minddp grade exercises/bucketed.py   # grade.py runs CHECKS["bucketed"] on every rank

What every DDP is graded on (shared/data_parallel.py), and the buckets' own: the LM in
buckets of 4 KB (several), and two branches that take turns, so that every other step a
later bucket is complete first: the order the buckets launch in is recorded, and must be
bucket order.
"""

import torch
import torch.nn.functional as F

from ..shared.data_parallel import _run, _verdict, on_the_edges, on_the_models
from ..shared.training import MODELS, _everyone, _ranks, toy_batch


class TakesTurns(torch.nn.Module):
    """Two branches whose order swaps every forward, and so their gradients' order in each
    backward: after the first backward the buckets are laid out in one order (stock's
    rebuild), and every other step the gradients arrive in the other."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = (torch.nn.Linear(2, 30), torch.nn.Linear(2, 30),
                                     torch.nn.Linear(30, 2))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        first, second = (self.a, self.b) if self.calls % 2 else (self.b, self.a)
        y = first(x)  # (autograd runs the later one's backward first)
        return self.head(torch.relu(second(x) + y))


def _in_bucket_order(launched):
    """{} if each backward launched its buckets 0, 1, 2, ... (stock's order), else the failure:
    the same numbers here, but ranks whose gradients arrive in other orders would pair their
    all_reduces with other buckets'. launched: [each backward's positions, in launch order]."""
    for step, mine in enumerate(launched):
        if mine != sorted(mine):
            later = next(p for p, q in zip(mine, sorted(mine)) if p != q)
            return dict(passed=False, outcome="failed", where=f"backward {step}: yours launched"
                        f" buckets {mine}", diagnosis=f"bucket {later} launched before bucket"
                        f" {min(mine[mine.index(later):])}: stock launches strictly in bucket"
                        f" order, a complete bucket waiting for the ones before it, so that each"
                        f" rank's all_reduces pair with the same buckets even where their"
                        f" gradients arrive in other orders")
    return {}


OUT_OF_ORDER = ("branches that take turns", TakesTurns, "SGD",
                lambda ps: torch.optim.SGD(ps, lr=0.5), toy_batch, F.cross_entropy)


ORDER_NOTE = ("stock multiplies each gradient by 1/world_size as it copies it into its"
              " bucket, then all_reduces the bucket")


def bucketed(student, rank, world_size):
    """BucketedDDP against stock DDP: the models, the LM in several buckets, branches that
    take turns (the order the buckets launch in), then what the models do not reach."""
    cls_name = "BucketedDDP"
    results = on_the_models(student, rank, world_size, cls_name, ORDER_NOTE)
    lm = MODELS[1]  # the LM's 6 gradients in buckets of 4 KB: several
    everyone = _everyone(_run(student, cls_name, rank, lm, bucket_cap_mb=0.004))
    results.append(_verdict(f"{_ranks(world_size)}, {lm[0]}, {lm[2]}, bucket_cap_mb=0.004"
                            f" (several buckets)", everyone, ORDER_NOTE))
    results.append(_taking_turns(student, rank, world_size, cls_name, results))
    return results + on_the_edges(student, rank, world_size, cls_name, ORDER_NOTE)


def _taking_turns(student, rank, world_size, cls_name, results):
    """Every other step a later bucket is complete first: it waits for the one before it.
    `results`: the checks before this one (a bucket never launched shows only here)."""
    cls, launched = getattr(student, cls_name), [[]]
    reduce, end = cls._reduce_bucket, cls._end_of_backward

    def recorded(self, bucket, position):  # the order _mark_ready launches the buckets
        launched[-1].append(position)
        return reduce(self, bucket, position)

    def ended(self):
        launched.append([])
        return end(self)
    cls._reduce_bucket, cls._end_of_backward = recorded, ended
    try:
        everyone = _everyone(_run(student, cls_name, rank, OUT_OF_ORDER,
                                  bucket_cap_mb=0.0002))
    finally:
        cls._reduce_bucket, cls._end_of_backward = reduce, end
    result = _verdict(f"{_ranks(world_size)}, {OUT_OF_ORDER[0]}, bucket_cap_mb=0.0002 (the"
                      f" gradients' order changes every step)", everyone, ORDER_NOTE)
    if "the average was skipped" in result["diagnosis"] and all(r["passed"] for r in results):
        result["diagnosis"] += ("; only here, so a bucket never launched: when one"
                                " gradient completes several buckets, launch each of them,"
                                " in bucket order")
    if result["passed"]:
        result.update(_in_bucket_order(launched))
    return result
