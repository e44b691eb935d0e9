"""Expert parallelism's routing: every all_to_all's splits checked, and a routing mistake named.

    minddp grade exercises/experts.py        # checks/experts.py routes through these

Every all_to_all_single is checked first on every rank of its group: splits that the ranks
do not agree on would leave gloo waiting; they are named (which rank sends how many rows to
whom, and what one process routes there) on every rank alike. The rows each expert is given
at step 0, if not one process's, are read here too: too many or too few, other rows, or the
right rows in another order.
"""

import contextlib

import numpy as np
import torch.distributed as dist

from .experts_reference import NUM_EXPERTS


class _Splits(Exception):
    """Splits the ranks of an all_to_all do not agree on (raised on every rank of it)."""

    def __init__(self, seen):
        super().__init__("splits")
        self.seen = seen  # each group rank's (output rows, input rows, out split, in split,
        # output elements, input elements)


@contextlib.contextmanager
def _agreed_splits(calls):
    """dist.all_to_all_single, checked first on every rank of its group: each rank's splits
    must add up to its tensors' rows and rank i's input_split[j] be rank j's output_split[i].
    `calls` collects each call's gathered splits (what the diagnosis reads)."""
    real = dist.all_to_all_single

    def checked(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        mine = (int(output.shape[0]), int(input.shape[0]),
                None if output_split_sizes is None else [int(s) for s in output_split_sizes],
                None if input_split_sizes is None else [int(s) for s in input_split_sizes],
                output.numel(), input.numel())
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, mine, group=group)
        calls.append(seen)
        if not _consistent(seen):
            raise _Splits(seen)
        return real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)
    dist.all_to_all_single = checked
    try:
        yield
    finally:
        dist.all_to_all_single = real


def _split(rows, split, size):
    return split if split is not None else [rows // size] * size


def _consistent(seen):
    size = len(seen)
    outs = [_split(o, s, size) for o, _, s, _, _, _ in seen]
    ins = [_split(i, s, size) for _, i, _, s, _, _ in seen]
    return all(sum(outs[r]) == seen[r][0] and sum(ins[r]) == seen[r][1] and len(outs[r]) ==
               len(ins[r]) == size for r in range(size)) and all(
        ins[i][j] == outs[j][i] for i in range(size) for j in range(size))


def _source(row, counts, expert, first, ep):
    """'rank q's row k of its n for it' for a row of `expert` in one process's order
    (source-major: each rank's rows for the expert, rank by rank)."""
    start = 0
    for q in range(first, first + ep):
        n = counts[q][expert]
        if row < start + n:
            return f"rank {q}'s row {row - start} of its {n} for it"
        start += n
    return "none"


def _rows_why(expert, rank, ours, theirs, counts, first, ep):
    order = ("within an expert its rows keep source order (rank by rank, each rank's pairs in"
             " its own order: a stable sort by expert), as one process's concatenation of the"
             " ranks' runs")
    if ours is None:
        return (f"expert {expert} (on rank {rank}) was never run: it is given"
                f" {len(theirs)} rows in one process")
    if ours.shape != theirs.shape:
        each = ", ".join(f"rank {q}'s {counts[q][expert]}" for q in range(first, first + ep))
        return (f"expert {expert} (on rank {rank}) got {len(ours)} rows, one process gives it"
                f" {len(theirs)} ({each}):"
                f" the rows from each rank regrouped by expert (3) with the counts each rank"
                f" sent (1)")
    match = []
    for row in ours:  # where each of your rows is in one process's order
        hits = np.nonzero((theirs == row).all(1))[0]
        match.append(int(hits[0]) if len(hits) else None)
    if None in match or sorted(match) != list(range(len(theirs))):
        k = next(k for k, m in enumerate(match) if m is None) if None in match else 0
        return (f"expert {expert} (on rank {rank}) got other rows than one process's: its row"
                f" {k} is no pair routed to it: the arrived rows come source-major (each"
                f" rank's run for my experts in turn); regroup them by expert (3) before the"
                f" experts run")
    k = next(k for k, m in enumerate(match) if m != k)
    return (f"expert {expert} (on rank {rank}) got the right {len(theirs)} rows in another"
            f" order: its row {k} is {_source(match[k], counts, expert, first, ep)}, one"
            f" process's is {_source(k, counts, expert, first, ep)}: {order}; another order"
            f" sums its gradient in another order")


def _splits_verdict(everyone, world_size, dp):
    ep = world_size // dp
    rank = next(r for r, e in enumerate(everyone) if "splits" in e)
    step, phase, call, seen = everyone[rank]["splits"]
    first = rank // ep * ep
    counts = everyone[rank]["reference"]["counts"]
    per_rank = NUM_EXPERTS // ep
    # what one process routes from group rank i to group rank j: i's pairs for j's experts
    routes = [[sum(counts[first + i][j * per_rank:(j + 1) * per_rank]) for j in range(ep)]
              for i in range(ep)]
    outs = [_split(o, s, ep) for o, _, s, _, _, _ in seen]
    ins = [_split(i, s, ep) for _, i, _, s, _, _ in seen]
    counted = next(((r, which, split) for r in range(ep) for which, split in
                    (("output", outs[r]), ("input", ins[r])) if len(split) != ep), None)
    if counted is not None:
        r, which, split = counted
        return False, (f"step {step}, {phase}, all_to_all number {call}: rank {first + r}'s"
                       f" {which} splits {split}, {len(split)} of them"), (
            f"all_to_all_single takes one split per rank of its group (ep = {ep}): split j is"
            f" the rows to (or from) rank j" + (f"; yours gives one per expert"
                                                f" ({NUM_EXPERTS}): add up each rank's run of"
                                                f" {NUM_EXPERTS // ep} experts"
                                                if len(split) == NUM_EXPERTS else ""))
    pair = next(((i, j) for i in range(ep) for j in range(ep) if ins[i][j] != outs[j][i]),
                None)
    if pair is None:  # every pair agrees: a rank's splits do not add up to its rows
        r = next(r for r in range(ep)
                 if sum(outs[r]) != seen[r][0] or sum(ins[r]) != seen[r][1])
        which = "output" if sum(outs[r]) != seen[r][0] else "input"
        held = seen[r][0] if which == "output" else seen[r][1]
        split = outs[r] if which == "output" else ins[r]
        where = (f"step {step}, {phase}, all_to_all number {call}: rank {first + r}'s {which}"
                 f" holds {held} rows, its {which} splits {split} add up to {sum(split)}")
        elements = seen[r][4] if which == "output" else seen[r][5]
        if sum(split) == elements != held:
            return False, where, (
                f"splits counted in elements, not rows: all_to_all_single's splits count"
                f" rows (slices along dim 0); rank {first + r}'s {which} is {held} rows of"
                f" {elements // max(held, 1)} elements, its {elements} elements are what"
                f" {split} adds up to: give each rank's share in rows"
                f" ({[n * held // elements for n in split]} here)")
    else:
        i, j = pair
        where = (
            f"step {step}, {phase}, all_to_all number {call}: rank {first + i} sends rank"
            f" {first + j} {ins[i][j]} rows, rank {first + j} expects {outs[j][i]} from it"
            + (f"; one process routes {routes[i][j]} of rank {first + i}'s pairs to rank"
               f" {first + j}'s experts" if phase == "the forward" else ""))
    if phase == "the backward":
        right = all(e["output"] is not None and np.array_equal(
            e["output"], e["reference"]["steps"][step]["(output)"]) for e in everyone)
        return False, where, (
            ("the forward is right, the backward is not: " if right else "") + "the"
            " gradients are not sent home: each row's gradient goes back to the rank it came"
            " from, the same all_to_all the other way (send and recv swapped)")
    if all(outs[r] == ins[r] for r in range(ep)):
        return False, where, (
            "the counts not exchanged: each rank expects from every rank what it sends"
            " itself: (1) an all_to_all of the counts tells each rank how many rows every"
            " rank sends to each of its experts")
    return False, where, (
        "the splits are not the counts' (1): rank i sends rank j its pairs for j's experts"
        " (a contiguous run, once sorted by expert), and expects from each rank the rows the"
        " counts' all_to_all said")
