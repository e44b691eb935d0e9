"""V-shaped pipelines: two stages per rank, down the ranks and back up; ZBV and DualPipeV.

    pytest tests/test_pp_interleaved.py -k "ZBV or DualPipeV"   # actions and bits: stock's

Looped stages (interleaved.py) send the activation from the last rank back to rank 0 at
every turn. A V places rank r's two stages at r and 2p-1-r: the model goes down the ranks
and comes back up, so the turn (stages p-1 and p) stays on rank p-1, and the last stage,
which starts every backward, sits on rank 0 beside the first. With the backward split into
I and W (zero_bubble.py), every slot of the step can hold work. In the order below:
  v_placement   stage s on rank s (s < p), else on rank 2p-1-s
  zbv           ZBV (zero bubble, V-shaped), stock's list written out
  dualpipev     DualPipeV (DeepSeek's DualPipe on a V), the same for its list
Stock's API: ScheduleZBVZeroBubble(stages, m, loss_fn) and ScheduleDualPipeV, each given
the rank's two PipelineStages; step() as before.
"""

import torch.distributed as dist

from .interleaved import _action, parse_action
from .zero_bubble import ZeroBubble
from ..launch.usage_error import UsageError


def v_placement(stage_index, pp):
    """The rank of stage `stage_index` when the stages go down the ranks and back up."""
    return stage_index if stage_index < pp else 2 * pp - 1 - stage_index


def zbv(rank, pp, n):
    """ZBV: rank r holds chunk 0 (stage r) and chunk 1 (stage 2p-1-r). Forwards of chunk 0
    fill the warm-up; each chunk-1 F is answered by its I and W; then F, I, W of both chunks
    in turn; the cool-down runs the Is first and leaves the Ws for last."""
    total = max(2 * pp - 1, n)  # the shape needs 2p-1 microbatches; extra slots run nothing
    c0, c1 = rank, 2 * pp - 1 - rank
    counts, actions = {}, [None] * rank

    def act(stage, kind, i=None):
        if i is None:
            i = counts[stage, kind] = counts.get((stage, kind), -1) + 1
        actions.append(_action(stage, kind, i))

    for _ in range(2 * (pp - rank) - 1):
        act(c0, "F")
    for _ in range(rank):
        act(c1, "F"), act(c0, "F")
    for _ in range(pp - rank):
        act(c1, "F"), act(c1, "I"), act(c1, "W")
    while counts.get((c1, "F"), -1) < counts[c0, "F"] or counts[c0, "F"] + 1 < total:
        if counts[c0, "F"] + 1 < total:
            act(c0, "F")
        act(c0, "I"), act(c0, "W"), act(c1, "F"), act(c1, "I"), act(c1, "W")
    w0, w1 = counts[c0, "W"] + 1, counts[c1, "W"] + 1
    for _ in range(rank):
        act(c0, "I"), act(c1, "I")
    for _ in range(pp - rank):
        act(c0, "I")
        act(c0, "W", w0)
        w0 += 1
    actions += [_action(c1, "W", i) for i in range(w1, counts[c1, "I"] + 1)]
    actions += [_action(c0, "W", i) for i in range(w0, counts[c0, "I"] + 1)]
    return [a if a is None or parse_action(a)[2] < n else None for a in actions]


def dualpipev(rank, pp, n):
    """DualPipeV: rank r's chunks c0 = stage r and c1 = stage 2p-1-r. After a warm-up of
    forwards, each slot pairs one chunk's forward with the other chunk's whole backward (F
    then B: stock's OVERLAP_F_B, whose two halves DeepSeek overlaps on a GPU); the
    cool-down splits backwards into I and W, the Ws waiting in a queue to fill what idles."""
    c0, c1 = rank, 2 * pp - 1 - rank
    counts, weights, actions = {}, [], []  # weights: the (stage, i) whose W is still due

    def act(stage, kind):
        key = (stage, "I" if kind == "B" else kind)  # a B counts as its I and its W
        i = counts.get(key, 0)
        actions.append(_action(stage, kind, i))
        counts[key] = i + 1
        if kind == "B":
            counts[stage, "W"] = counts.get((stage, "W"), 0) + 1
        elif kind == "I":
            weights.append((stage, i))

    def pending_weight():
        if weights:
            stage, i = weights.pop(0)
            actions.append(_action(stage, "W", i))

    for _ in range(2 * (pp - rank - 1)):
        act(c0, "F")
    for _ in range(rank + 1):
        act(c0, "F"), act(c1, "F")
    for _ in range(pp - rank - 1):
        act(c1, "I"), pending_weight(), act(c1, "F")
    for _ in range(n - 2 * pp + rank + 1):  # overlapped pairs (on rank p-1 the first one
        act(c0, "F"), act(c1, "B")         # is two plain actions in stock's list)
        act(c1, "F"), act(c0, "B")
    for _ in range(pp - rank - 1):
        act(c1, "B"), act(c1, "F"), act(c0, "B")
    split = False
    for step in range(rank + 1):  # from the middle on, the backwards split (odd ranks sooner)
        split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
        act(c1, "I" if split else "B")
        split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
        act(c0, "I" if split else "B")
    for _ in range(pp - rank - 1):
        pending_weight(), act(c0, "I" if split else "B")
    for _ in range(rank + 1):
        pending_weight()
    return actions


class VShaped(ZeroBubble):
    """Two stages per rank, placed in a V."""

    placement = staticmethod(v_placement)

    def __init__(self, stages, n_microbatches, loss_fn=None):
        stages = list(stages)  # the count first: a V of more stages has no placement
        ranks = dist.get_world_size(stages[0].group)
        if stages[0].num_stages != 2 * ranks:
            raise UsageError(f"{type(self).__name__} runs 2 stages per rank, not"
                             f" {stages[0].num_stages / ranks:g}", same_on_every_rank=True,
                             hint=f"cut the model into {2 * ranks} stages, two per rank")
        super().__init__(stages, n_microbatches, loss_fn)


class ScheduleZBVZeroBubble(VShaped):
    """ZBV: F, I and W interleaved on the V so that no slot idles."""

    def order(self):
        return self.parsed(zbv(self.rank, self.pp, self.n))


class ScheduleDualPipeV(VShaped):
    """DualPipeV: forward of one chunk beside backward of the other, in every steady slot."""

    def __init__(self, stages, n_microbatches, loss_fn=None):
        super().__init__(stages, n_microbatches, loss_fn)
        if n_microbatches < 2 * self.pp:
            raise UsageError(f"DualPipeV with {n_microbatches} microbatches on"
                             f" {2 * self.pp} stages: it needs at least one per stage",
                             same_on_every_rank=True,
                             hint=f"use {2 * self.pp} or more microbatches (stock refuses"
                                  " fewer too)")

    def order(self):
        return self.parsed(dualpipev(self.rank, self.pp, self.n))
