"""The expert-parallel check: the student's experts on ranks beside one process on the whole
batch (minddp/references/moe.py), bit for bit.

    minddp grade exercises/experts.py        # grade.py runs CHECKS["experts"] on every rank

One MoE layer (8 experts, experts.py) under the student's expert_parallel, each rank its own
number of tokens (6 + 2 rank: uneven splits), 2 AdamW steps after the student's
sync_gradients; beside it the layer in one process on every rank's tokens, each expert run
once per ep group on the rows in the order (source rank, token), as tests/test_experts.py
does. Compared: the rows each expert is given (step 0), each rank's output, the input's
gradient, every gradient before and after sync_gradients, and every weight after the step.
The reference's replicated weights are averaged by the same gloo all_reduce of the same
rank parts the student's sync makes (gloo adds 4 ranks in an order of its own), so a
right sync_gradients is the reference's bits at every world size.
Every all_to_all_single is checked first on every rank of its group: splits that the ranks
do not agree on would leave gloo waiting; they are named (which rank sends how many rows to
whom, and what one process routes there) on every rank alike.
"""

import contextlib
import copy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ep.experts import MoE
from ..references.moe import one_process_moe, rank_order_sum
from .training import _everyone, _np, _ranks, _result

STEPS = 2
NUM_EXPERTS = 8
# (dp, top_k, capacity_factor) per world size: pure ep and dp x ep, top-1 and top-2,
# dropless and with a capacity (the first C pairs of each expert kept).
CASES = {1: [(1, 2, None)], 2: [(1, 1, None), (1, 2, 1.25)],
         4: [(1, 2, 1.25), (2, 2, None), (2, 1, 1.0)]}


def _tokens(rank, step):
    """Rank r's tokens and targets at a step: 6 + 2r of them, its own seed."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6 + 2 * rank, 8, generator=g), torch.randn(6 + 2 * rank, 8, generator=g)


class _Splits(Exception):
    """Splits the ranks of an all_to_all do not agree on (raised on every rank of it)."""

    def __init__(self, seen):
        super().__init__("splits")
        self.seen = seen  # each group rank's (output rows, input rows, out split, in split)


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
                None if input_split_sizes is None else [int(s) for s in input_split_sizes])
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
    outs = [_split(o, s, size) for o, _, s, _ in seen]
    ins = [_split(i, s, size) for _, i, _, s in seen]
    return all(sum(outs[r]) == seen[r][0] and sum(ins[r]) == seen[r][1] and len(outs[r]) ==
               len(ins[r]) == size for r in range(size)) and all(
        ins[i][j] == outs[j][i] for i in range(size) for j in range(size))


def experts(student, rank, world_size):
    """Each case of CASES[world_size]: the student's layer beside one process, STEPS steps."""
    results = []
    for dp, top_k, capacity in CASES[world_size]:
        label = (f"{_ranks(world_size)}, " + (f"dp={dp} x ep={world_size // dp}" if dp > 1 else
                                             f"ep={world_size}")
                 + f", top-{top_k}, " + ("dropless" if capacity is None else
                                         f"capacity factor {capacity}") + ", AdamW")
        record = _case(student, rank, world_size, dp, top_k, capacity)
        everyone = _everyone(record)
        results.append(_result(label, *_verdict(everyone, world_size, dp)))
    return results


def _case(student, rank, world_size, dp, top_k, capacity):
    """This rank's record of one case: {"yours", "reference"}; or, where a rank's all_to_all
    splits disagreed or autograd refused a gradient, what it saw ("splits", "raised")."""
    from ..mesh.device_mesh import init_device_mesh
    torch.manual_seed(0)
    layer = MoE(8, 16, NUM_EXPERTS, top_k=top_k, capacity_factor=capacity)
    master = copy.deepcopy(layer)
    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "ep"))
    student.expert_parallel(layer, mesh)
    mine = [int(e) for e in layer.experts.mlps] if hasattr(layer.experts, "mlps") else []
    seen_rows = {}
    for e in mine:  # the rows each of this rank's experts is given, at step 0
        layer.experts.mlps[str(e)].register_forward_hook(_keep_rows(seen_rows, e))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
                  for m in (layer, master)]
    yours, reference = {"steps": [], "rows": seen_rows}, {"steps": [], "rows": {}}
    for step in range(STEPS):
        # The reference first, on every rank alike (its all_reduce is the world's): a rank
        # whose student code fails below still has it, and no rank is left waiting in it.
        _reference_step(master, rank, world_size, dp, step, mine, reference)
        x, target = _tokens(rank, step)
        x.requires_grad_()
        out, failed, calls, phase = None, None, [], "the forward"
        try:
            with _agreed_splits(calls):
                out = layer(x)
                phase = "the backward"
                (F.mse_loss(out, target) + 0.01 * layer.balance_loss).backward()
        except _Splits as error:
            failed = {"splits": (step, phase, len(calls), error.seen)}
        except RuntimeError as error:
            if "returned an invalid gradient" not in str(error):
                raise
            # autograd refuses a gradient of another shape than the rows it is for
            failed = {"raised": (step, str(error).splitlines()[0])}
        # Every rank learns whether one failed, so that all stop here together.
        if any(_everyone(failed is not None)):
            return {**(failed or {"stopped": step}), "output": _np(out),
                    "reference": reference}
        local = {n: _np(p.grad) for n, p in layer.named_parameters()}
        student.sync_gradients(layer, mesh)
        yours["steps"].append({"(output)": _np(out), "(the input's gradient)": _np(x.grad),
                               "local": local,
                               "grads": {n: _np(p.grad) for n, p in layer.named_parameters()}})
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    theirs = {n: _np(p) for n, p in master.named_parameters()}
    yours["weights"] = {n: _np(p) for n, p in layer.named_parameters()}
    reference["weights"] = {n: theirs[n] for n in yours["weights"]}
    return {"yours": yours, "reference": reference}


def _keep_rows(rows, expert):
    """A forward hook keeping the first rows `expert` is given (it returns None: a hook that
    returned them would replace the expert's output)."""
    def hook(module, args, output):
        rows.setdefault(expert, _np(args[0]))
    return hook


def _reference_step(master, rank, world_size, dp, step, mine, reference):
    """One process on every rank's tokens (references/moe.py): this rank's part of it, and
    master's gradients set to the synchronized reference's."""
    ep = world_size // dp
    data = [_tokens(r, step) for r in range(world_size)]
    xs = [d[0].clone().requires_grad_() for d in data]
    routers = [copy.deepcopy(master.router) for _ in range(world_size)]
    held = [copy.deepcopy(master.experts) for _ in range(dp)]
    rows = {}
    if step == 0:
        for e in mine:
            held[rank // ep].mlps[str(e)].register_forward_hook(_keep_rows(rows, e))
    outs, balances, counts = one_process_moe(routers, held, master, xs, ep)
    torch.autograd.backward([F.mse_loss(o, d[1]) + 0.01 * b
                             for o, d, b in zip(outs, data, balances)])
    names = [n for n, _ in master.named_parameters()]
    local = {"router.weight": routers[rank].weight.grad.clone()}
    for name, p in held[rank // ep].named_parameters():
        local[f"experts.{name}"] = p.grad
    # The replicated weights: the same gloo all_reduce of the same rank parts as the
    # student's sync makes; an expert's: over the ep groups in group order (dp is 1 or 2,
    # where gloo's sum is a + b too); each divided by W.
    router = routers[rank].weight.grad.clone()
    dist.all_reduce(router)
    master.router.weight.grad = router / world_size
    for name, p in master.experts.named_parameters():
        p.grad = rank_order_sum([dict(h.named_parameters())[name].grad
                                 for h in held]) / world_size
    grads = {n: _np(p.grad) for n, p in master.named_parameters()}
    if step == 0:
        reference["rows"] = rows
        reference["counts"] = [c.tolist() for c in counts]
    reference["steps"].append({"(output)": _np(outs[rank]),
                               "(the input's gradient)": _np(xs[rank].grad),
                               "local": {n: _np(g) for n, g in local.items()},
                               "grads": {n: grads[n] for n in names}})


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
    outs = [_split(o, s, ep) for o, _, s, _ in seen]
    ins = [_split(i, s, ep) for _, i, _, s in seen]
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


CHECKS = {"experts": experts}
