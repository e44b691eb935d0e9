"""Virtual pipeline stages: several stages per rank, and the schedules that interleave them.

    pytest tests/test_pp_interleaved.py   # every rank's actions: stock's, action for action

With one stage per rank the bubble is (p-1)/(m+p-1) of a step: p-1 slots of waiting at
each end. Cut the model into v*p stages instead, v per rank, and a microbatch visits every
rank v times: each slot is v times shorter, so the bubble shrinks to (p-1)/(v*m+p-1). The
stages sit on the ranks in a loop: stage s on rank s % p (rank 0 holds 0, p, 2p, ...), so
stage s's activation always goes to the next rank and wraps from the last rank to rank 0.

A schedule is a list of actions per rank, "sFi": stage s does F(orward) or B(ackward) of
microbatch i (stock's notation, `torch.distributed.pipelining.schedules._Action`); None is
a slot the rank waits (it keeps the ranks' lists aligned in time, and runs nothing). The
lists below are stock's, written out; stage.py's loop runs them. In the order they appear:
  loop_placement    stage s on rank s % p
  parse_action      "2F0" -> (2, "F", 0), for every schedule's runner and tool
  looped_bfs        breadth first: every microbatch through stage r, then r+p, ...; the
                    backwards from the last local stage, latest microbatch first
  interleaved_1f1b  depth first (Megatron's interleaved 1F1B): a warm-up of forwards
                    round-robin over the local stages, then one F and one B, then the Bs
  ScheduleMulti     schedules.py's loop, given this rank's stages and its list
Stock's API (torch.distributed.pipelining): one PipelineStage per local stage, then
ScheduleInterleaved1F1B(stages, m, loss_fn) or ScheduleLoopedBFS; step() as before.
"""

import re

import torch.distributed as dist

from .schedules import Schedule
from ..launch.usage_error import UsageError


def loop_placement(stage_index, pp):
    """The rank of stage `stage_index` when the stages go round the ranks in order."""
    return stage_index % pp


def _action(stage, kind, i):
    return f"{stage}{kind}{i}"


def parse_action(action):
    """"2F0" -> (2, "F", 0): the stage, the kind (F, B, I or W), the microbatch."""
    stage, kind, i = re.fullmatch(r"(\d+)([FBIW])(\d+)", action).groups()
    return int(stage), kind, int(i)


def looped_bfs(rank, pp, n_local, n):
    """Breadth first: all n forwards of the rank's first stage, then of its next, ...; then
    the backwards, last stage first, each stage's microbatches in reverse order."""
    stages = range(rank, pp * n_local, pp)
    actions = [None] * rank  # the first activation needs `rank` slots to arrive
    actions += [_action(s, "F", i) for s in stages for i in range(n)]
    actions += [None] * (2 * (pp - 1 - rank))  # the first gradient: 2 slots per hop back
    actions += [_action(s, "B", i) for s in reversed(stages) for i in reversed(range(n))]
    return actions


def rounds(pp, n, what="Interleaved 1F1B"):
    """Microbatches per round (a round: each local stage's turn): n // max(1, n // pp)."""
    count = max(1, n // pp)
    if n % count:
        raise UsageError(f"{what} with {n} microbatches on {pp} ranks: {n} is not a multiple"
                         f" of the {count} rounds (n // ranks)", same_on_every_rank=True,
                         hint=f"use a number of microbatches that {count} divides, e.g. {pp}")
    return n // count


def interleaved_1f1b(rank, pp, n_local, n, zero_bubble=False):
    """Depth first: forwards round-robin over the local stages, `per_round` microbatches at
    a stage before moving on, so microbatch 0 reaches the last stage early; its backward
    starts the steady state of one F and one B; the backwards then go round the stages in
    reverse. The rank further from the last stage warms up with 2 more forwards per hop.
    zero_bubble (zero_bubble.py): 1 more per hop, each B split into I now and W later."""
    per_round = rounds(pp, n, "Zero bubble" if zero_bubble else "Interleaved 1F1B")
    hop = 1 if zero_bubble else 2
    warmup = min((n_local - 1) * per_round + hop * (pp - 1 - rank), n * n_local)
    total = n * n_local  # forwards (and backwards) this rank runs

    def forward_stage(op):  # op-th forward: local stage (op // per_round) % n_local
        return (op // per_round) % n_local * pp + rank

    def backward_stage(op):
        return (n_local - 1 - (op - warmup) // per_round % n_local) * pp + rank

    counts = {}  # (stage, kind) -> the next microbatch of that stage

    def act(stage, kind):
        i = counts[stage, kind] = counts.get((stage, kind), -1) + 1
        return _action(stage, kind, i)

    actions, backward_ops = [None] * rank, []
    for op in range(warmup):
        actions.append(act(forward_stage(op), "F"))
    # idle until the first backward arrives: slot n_local*pp + 2*(pp-1-rank) of the step
    # (zero bubble: a W fills what would be idle, so only the hops back are waited for)
    idle = pp - rank - 1 if zero_bubble else n_local * pp + 2 * (pp - 1 - rank) - warmup - rank
    actions += [None] * idle
    for op in range(warmup, total + warmup):  # steady state: one F, one B; then the Bs left
        if op < total:
            actions.append(act(forward_stage(op), "F"))
        elif not zero_bubble:
            actions.append(None)  # the cool-down waits a slot for each gradient
        actions.append(act(backward_stage(op), "I" if zero_bubble else "B"))
        backward_ops.append(op)
        if zero_bubble and op - warmup >= rank:  # after `rank` 1F1B pairs, a W per I
            actions.append(act(backward_stage(backward_ops[counts_w(counts)]), "W"))
    while zero_bubble and counts_w(counts) < len(backward_ops):  # the Ws left, in I's order
        actions.append(act(backward_stage(backward_ops[counts_w(counts)]), "W"))
    return actions


def counts_w(counts):
    """How many W actions have been placed so far."""
    return sum(i + 1 for (_, kind), i in counts.items() if kind == "W")


class ScheduleMulti(Schedule):
    """Several stages on this rank (stock's PipelineScheduleMulti): rank_actions(rank, p,
    stages per rank, m) is the rank's list; placement(s, p) the rank of stage s."""

    rank_actions = staticmethod(interleaved_1f1b)
    placement = staticmethod(loop_placement)

    def __init__(self, stages, n_microbatches, loss_fn=None):
        super().__init__(list(stages), n_microbatches, loss_fn)
        group = self.stage.group
        self.pp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_local = self.stage.num_stages // self.pp
        mine = [s for s in range(self.stage.num_stages) if self.placement(s, self.pp) ==
                self.rank]
        if sorted(s.index for s in self.stages) != mine:  # the same answer on every rank
            raise UsageError(f"{type(self).__name__} places stages {mine} on rank"
                             f" {self.rank}, which was given stages"
                             f" {sorted(s.index for s in self.stages)}",
                             hint="give each rank the stages of the schedule's placement")
        for stage in self.stages:
            stage.place(lambda s: self.placement(s, self.pp))
        self.log = []  # the actions run, "sFi", in order

    def order(self):
        return self.parsed(self.rank_actions(self.rank, self.pp, self.n_local, self.n))

    def parsed(self, actions):
        """["0F0", None, "2F0", ...] -> [(stage 0, "F", 0), (stage 2, "F", 0), ...]."""
        by_index = {stage.index: stage for stage in self.stages}
        actions = [a for a in actions if a]
        self.log = actions
        return [(by_index[s], kind, i) for s, kind, i in map(parse_action, actions)]


class ScheduleInterleaved1F1B(ScheduleMulti):
    rank_actions = staticmethod(interleaved_1f1b)


class ScheduleLoopedBFS(ScheduleMulti):
    rank_actions = staticmethod(looped_bfs)
