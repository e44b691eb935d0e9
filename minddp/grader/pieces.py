"""The grader's checks of the pieces that train nothing: the sampler, the broadcast, 1F1B's
order, the ring.

    minddp grade exercises/sampler.py        # grade.py runs CHECKS[exercise] on every rank

Each check runs on every rank, gathers what every rank saw, and returns the same results on
each: [{"check", "passed", "where", "diagnosis"}], the first difference and why.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # before any group
from torch.utils.data.distributed import DistributedSampler

from .pairing import unpaired
from .training import _everyone, _ranks, _result

SIZES = (1, 5, 7, 10, 16, 17)  # dataset lengths: some every rank count divides, some none


def sampler(student, rank, world_size):
    """ShardSampler against DistributedSampler: every index, every epoch, every setting."""
    results = []
    for shuffle in (True, False):
        for drop_last in (False, True):
            seen = {}
            for n in SIZES:
                for seed in (0, 3):
                    for who, cls in (("yours", student.ShardSampler),
                                     ("stock", DistributedSampler)):
                        s = cls(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                seed=seed, drop_last=drop_last)
                        for epoch in range(3):
                            s.set_epoch(epoch)
                            seen[who, n, seed, epoch] = list(s)
            everyone = _everyone(seen)
            label = f"{_ranks(world_size)}, shuffle={shuffle}, drop_last={drop_last}"
            results.append(_result(label, *_sampler_verdict(everyone, world_size, shuffle)))
    # Stock draws from a generator of its own: the training's random numbers (dropout,
    # augmentation, initialisation) are the same whether or not a sampler ran.
    before = torch.get_rng_state()
    s = student.ShardSampler(range(10), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    s.set_epoch(1)
    list(s)
    touched = not torch.equal(before, torch.get_rng_state())
    results.append(_result(f"{_ranks(world_size)}, torch's global random state", not touched,
                           "after set_epoch(1) and one epoch's indices" if touched else "",
                           "the sampler moved or reset torch's global random state"
                           " (torch.manual_seed or a draw without a generator): every rank's"
                           " dropout and initialisation change with it; shuffle with a"
                           " torch.Generator of its own, seeded seed + epoch" if touched else ""))
    return results


def _sampler_verdict(everyone, world_size, shuffle):
    for n in SIZES:
        for seed in (0, 3):
            for epoch in range(3):
                for rank in range(world_size):
                    yours = everyone[rank]["yours", n, seed, epoch]
                    stock = everyone[rank]["stock", n, seed, epoch]
                    if yours == stock:
                        continue
                    at = next((i for i, (a, b) in enumerate(zip(yours, stock)) if a != b),
                              min(len(yours), len(stock)))
                    where = (f"{n} examples, seed {seed}, epoch {epoch}, rank {rank}, position"
                             f" {at}: yours {yours[at:at + 3]}..., stock's {stock[at:at + 3]}...")
                    return False, where, _sampler_why(everyone, world_size, n, seed, epoch, rank,
                                                      shuffle)
    return True, "", ""


def _sampler_why(everyone, world_size, n, seed, epoch, rank, shuffle):
    def all_ranks(who, e):
        return [everyone[r][who, n, seed, e] for r in range(world_size)]
    yours, stock = all_ranks("yours", epoch), all_ranks("stock", epoch)
    if epoch and yours == all_ranks("yours", 0) and stock != all_ranks("stock", 0):
        return ("the same order every epoch: seed the generator with seed + epoch (what"
                " set_epoch is for)")
    if len(yours[rank]) != len(stock[rank]):
        return (f"rank {rank} gets {len(yours[rank])} indices, stock's {len(stock[rank])}:"
                f" every rank must get as many (pad by cycling from the start, or with"
                f" drop_last cut the tail), or a rank waits in a collective forever")
    order = ("shuffled by torch.randperm(n) with a generator seeded seed + epoch, before the"
             " padding and the dealing" if shuffle else "shuffle=False keeps 0 .. n-1 in order")
    if all(sorted(a) == sorted(b) for a, b in zip(yours, stock)):
        return f"each rank gets stock's indices, in another order: {order}"
    stocks_order = [stock[i % world_size][i // world_size] for i in range(sum(map(len, stock)))]
    if sum(yours, []) == stocks_order:
        return ("the same indices, dealt to other ranks: stock deals positions rank,"
                " rank + num_replicas, rank + 2 * num_replicas, ... (not a block per rank)")
    if len({len(y) for y in yours}) == 1:  # dealt as stock deals: the order it was dealt from
        dealt = [yours[i % world_size][i // world_size] for i in range(sum(map(len, yours)))]
        if dealt[:n] == stocks_order[:n]:
            return ("the order is stock's, what pads it is not: stock pads to total_size by"
                    " cycling from the start of the order (position i takes order[i % n])")
    if set(sum(yours, [])) == set(stocks_order):
        return f"the same indices over all ranks, in another order: {order}"
    return ("other indices than stock's: the order (torch.randperm(n) with a generator seeded"
            " seed + epoch; 0 .. n-1 without shuffle) or what pads it")


def broadcast(student, rank, world_size):
    """broadcast_parameters: each case's parameters and buffers against rank src's own."""
    others = dist.new_group(list(range(1, world_size)))  # a group without global rank 0
    cases = [("src=0", dict(src=0), None, list(range(world_size))),
             (f"src={world_size - 1}", dict(src=world_size - 1), None, list(range(world_size))),
             ("src=0, buffers=False", dict(src=0, buffers=False), None, list(range(world_size))),
             (f"a group of ranks 1-{world_size - 1}, src=0 (global rank 1)",
              dict(src=0, group=others), others, list(range(1, world_size)))][
        :4 if world_size > 2 else 3]  # (a group without rank 0 needs 3 ranks or more)
    results = []
    for label, kwargs, group, members in cases:
        torch.manual_seed(rank)  # every rank its own values
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        model[1].running_mean.fill_(rank)
        model[0].bias.requires_grad_(False)  # frozen: stock's DDP broadcasts it too
        before = {n: t.clone() for n, t in model.state_dict().items()}
        if rank in members:
            student.broadcast_parameters(model, **kwargs)
        after = {n: t.clone() for n, t in model.state_dict().items()}
        everyone = _everyone((before, after))
        src = members[kwargs["src"]]  # the group rank's global rank
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        verdict = _broadcast_verdict(everyone, members, src, kwargs.get("buffers", True),
                                     dict(model.named_buffers()), frozen)
        results.append(_result(f"{_ranks(world_size)}, {label}", *verdict))
    return results


def _broadcast_verdict(everyone, members, src, buffers, buffer_names, frozen):
    for rank in members:
        before, after = everyone[rank]
        for name, value in after.items():
            is_buffer = name in buffer_names
            wanted = everyone[src][0][name] if buffers or not is_buffer else before[name]
            if torch.equal(value, wanted):
                continue
            where = f"rank {rank}, {name}"
            holder = next((r for r in range(len(everyone))
                           if torch.equal(value, everyone[r][0][name])), None)
            if is_buffer and not buffers:
                return False, where, "a buffer was copied, though buffers=False"
            if holder == rank:
                return False, where, (f"rank {rank} still holds its own {name}: nothing was"
                                      f" copied into it, in place (the optimizer holds these"
                                      f" very tensors)" + (" (buffers count too)"
                                                            if is_buffer else
                                                            " (a frozen parameter too)"
                                                            if name in frozen else ""))
            if holder is not None:
                return False, where, (f"rank {rank} holds rank {holder}'s {name}, not rank"
                                      f" {src}'s: src is a rank of the group; send it with its"
                                      f" global rank (groups.global_rank)")
            return False, where, f"rank {rank} holds values of {name} no rank had"
    return True, "", ""


def pp(student, rank, world_size):
    """one_f_one_b's list against the order stock's Schedule1F1B runs each stage's actions."""
    results = []
    for n in (world_size, 2 * world_size + 1):
        torch.manual_seed(0)
        stage = PipelineStage(torch.nn.Linear(4, 4), rank, world_size, torch.device("cpu"))
        log = []
        for kind, method in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            original = getattr(stage, method)
            setattr(stage, method, lambda i, *a, _o=original, _k=kind, **k: (
                log.append((_k, i)), _o(i, *a, **k))[1])
        schedule = Schedule1F1B(stage, n, loss_fn=F.mse_loss)
        x, y = torch.randn(2 * n, 4), torch.randn(2 * n, 4)
        if rank == 0:
            schedule.step(x) if world_size > 1 else schedule.step(x, target=y)
        elif rank == world_size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        yours = [tuple(action) for action in student.one_f_one_b(rank, world_size, n)]
        everyone = _everyone((yours, log))
        results.append(_result(f"{_ranks(world_size)}, {n} microbatches",
                               *_order_verdict(everyone, world_size)))
    if world_size > 2:  # fewer microbatches than stages: stock's 1F1B refuses to run it, so
        n = world_size - 1  # the reference is its rule, warm-up min(n, num_stages - stage)
        yours = [tuple(a) for a in student.one_f_one_b(rank, world_size, n)]
        rule = _one_f_one_b_rule(rank, world_size, n)
        everyone = _everyone((yours, rule))
        results.append(_result(f"{_ranks(world_size)}, {n} microbatches (fewer than stages:"
                               f" stock's rule, which its Schedule1F1B refuses to run)",
                               *_order_verdict(everyone, world_size)))
    return results


def _one_f_one_b_rule(stage, num_stages, n):
    """Stock's 1F1B order written out: min(n, num_stages - stage) forwards, then B and F in
    turn, the oldest first, then the backwards left."""
    warmup = min(n, num_stages - stage)
    actions = [("F", i) for i in range(warmup)]
    for i in range(n):
        actions.append(("B", i))
        if warmup + i < n:
            actions.append(("F", warmup + i))
    return actions


def _order_verdict(everyone, world_size):
    for stage, (yours, stock) in enumerate(everyone):
        if yours == stock:
            continue
        at = next((i for i, (a, b) in enumerate(zip(yours, stock)) if a != b),
                  min(len(yours), len(stock)))
        where = (f"stage {stage}, action {at}: yours {_name(yours, at)}, stock's"
                 f" {_name(stock, at)}")
        if sorted(yours) != sorted(stock):
            extra = sorted(set(yours) - set(stock)) or sorted(set(stock) - set(yours))
            return False, where, (f"actions missing or repeated ({_name(extra, 0)}): every"
                                  f" microbatch's F and B once each, n = {len(stock) // 2} of"
                                  f" them (a warm-up of num_stages - stage_index forwards is"
                                  f" at most n)")
        warm = next((i for i, a in enumerate(stock) if a[0] == "B"), len(stock))
        mine = next((i for i, a in enumerate(yours) if a[0] == "B"), len(yours))
        if mine == warm:  # the warm-up is right: what comes after it is not
            return False, where, (f"after a right warm-up of {warm} forwards, the steady"
                                  f" state: stock runs one backward, then one forward, in"
                                  f" turn, the oldest first; at action {at} yours runs"
                                  f" {_name(yours, at)}, stock's {_name(stock, at)}")
        also = (": a warm-up one too long, or a steady state that runs F before B (one list:"
                " stock's runs B, then F)" if mine == warm + 1 else "")
        return False, where, (f"the warm-up: stock runs {warm} forwards before stage"
                              f" {stage}'s first backward (num_stages - stage_index of them,"
                              f" at most n), yours {mine}{also}")
    return True, "", ""


def _name(actions, i):
    return f"{actions[i][0]}{actions[i][1]}" if i < len(actions) else "(none)"


def ring(student, rank, world_size):
    """ring_reduce_scatter on gloo's blocks, then the lesson's ring_all_gather (the all_reduce
    of ring_all_reduce.py), against gloo's all_reduce; the file's reduce_scatter_tensor
    against gloo's. Bit for bit, every rank: SUM, AVG, MAX, sizes W divides and does not."""
    from ..collectives.ops import finish
    from ..collectives.ring_all_gather import ring_all_gather
    from ..collectives.ring_all_reduce import gloo_blocks
    sizes = (1, 7, 4 * world_size, 4 * world_size + 1, 1000)
    for n in sizes:  # first, without a message moved: a send that no receive meets hangs
        blocks = gloo_blocks(_ring_values(rank, n, torch.float32), world_size)
        hit = unpaired(lambda: student.ring_reduce_scatter(blocks, dist.ReduceOp.SUM, None),
                       f"ring_reduce_scatter of {n} element{'s' * (n != 1)}")
        if hit:
            return [_result(f"{_ranks(world_size)}, ring_reduce_scatter's sends and receives"
                            f" pair up: {', '.join(map(str, sizes))} elements", False, *hit)]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        seen = {}
        for n in sizes:
            x = _ring_values(rank, n, dtype)
            edges = [len(b) for b in gloo_blocks(torch.empty(n), world_size)]
            for op in ("SUM", "AVG", "MAX"):
                yours, stock = x.clone(), x.clone()
                blocks = gloo_blocks(yours, world_size)
                student.ring_reduce_scatter(blocks, getattr(dist.ReduceOp, op), None)
                ring_all_gather(blocks, None)
                finish(getattr(dist.ReduceOp, op), yours, world_size)
                dist.all_reduce(stock, op=getattr(dist.ReduceOp, op))
                block_of = [b for b, length in enumerate(edges) for _ in range(length)]
                key = f"all_reduce {op}, {n} element{'s' * (n != 1)}"
                seen[key] = (x, yours, stock, list(range(n)), block_of, op)
        everyone = _everyone(seen)
        results.append(_result(f"{_ranks(world_size)}, all_reduce (your reduce_scatter, the"
                               f" lesson's all_gather), {str(dtype)[6:]}: SUM, AVG, MAX,"
                               f" {', '.join(map(str, sizes))} elements",
                               *_ring_verdict(everyone, world_size)))
    seen = {}  # (torch 2.13 calls it reduce_scatter_single, and warns at the old name)
    gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    for dtype in (torch.float32, torch.bfloat16):
        for per_rank in (2, 6):  # even: gloo's blocks are the pieces, its bits are the ring's
            x = _ring_values(rank, per_rank * world_size, dtype)
            for op in ("SUM", "AVG"):
                yours, stock = torch.empty(per_rank, dtype=dtype), torch.empty(per_rank,
                                                                                dtype=dtype)
                student.reduce_scatter_tensor(yours, x, op=getattr(dist.ReduceOp, op))
                gloo_reduce_scatter(stock, x, op=getattr(dist.ReduceOp, op))
                seen[f"reduce_scatter_tensor {op}, {str(dtype)[6:]}, {per_rank} elements a"
                     f" rank"] = (x, yours, stock, [rank * per_rank + i for i in
                                                    range(per_rank)], [rank] * per_rank, op)
    everyone = _everyone(seen)
    results.append(_result(f"{_ranks(world_size)}, reduce_scatter_tensor: SUM, AVG, float32"
                           f" and bfloat16", *_ring_verdict(everyone, world_size)))
    results.append(_result(f"{_ranks(world_size)}, what the ring sends: W - 1 blocks a rank",
                           *_ring_sends(student, rank, world_size)))
    return results


def _ring_sends(student, rank, world_size):
    """The elements this rank's ring_reduce_scatter sends, of 4 * W: a ring sends W - 1
    blocks of 4, its (W - 1) / W. (A right result may hide a step too many: the all_gather
    after it overwrites the block that step spoiled.)"""
    from ..collectives.ring_all_reduce import gloo_blocks
    sent, batch, send = [], dist.batch_isend_irecv, dist.send

    def counted_batch(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op.__name__ == "isend")
        return batch(ops)

    def counted_send(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return send(tensor, *args, **kwargs)
    dist.batch_isend_irecv, dist.send = counted_batch, counted_send
    try:
        blocks = gloo_blocks(_ring_values(rank, 4 * world_size, torch.float32), world_size)
        student.ring_reduce_scatter(blocks, dist.ReduceOp.SUM, None)
    finally:
        dist.batch_isend_irecv, dist.send = batch, send
    everyone, ring = _everyone(sum(sent)), 4 * (world_size - 1)
    more = [r for r, elements in enumerate(everyone) if elements > ring]
    if not more:
        return True, ""
    return False, f"rank {more[0]}", (
        f"rank {more[0]} sent {everyone[more[0]]} elements of its {4 * world_size} in"
        f" ring_reduce_scatter, a ring {ring}: W - 1 = {world_size - 1} steps of one block"
        f" each; a step more sends a block already reduced round again (the result can still"
        f" be right: the all_gather after it overwrites that block), and costs what the ring"
        f" saves")


def _ring_values(rank, n, dtype):
    """Rank r's own values: of every size, so that another order rounds another way."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g) * 2.0 ** torch.randint(-4, 5, (n,), generator=g)
            ).to(dtype)


def _ring_verdict(everyone, world_size):
    for key in everyone[0]:
        for rank in range(world_size):
            _, yours, stock, at, block_of, op = everyone[rank][key]
            if torch.equal(yours, stock):
                continue
            i = int((yours != stock).nonzero()[0])
            b = block_of[i]
            where = (f"{key}, rank {rank}, element {i} (block {b}): yours"
                     f" {float(yours[i])!r}, gloo's {float(stock[i])!r}")
            mine = [float(everyone[r][key][0][at[i]]) for r in range(world_size)]
            return False, where, _ring_why(op, mine, b, float(yours[i]), float(stock[i]),
                                           yours.dtype, world_size)
    return True, "", ""


def _ring_why(op, x, b, yours, stock, dtype, world_size):
    """Why block b's element reads `yours`: x[r] is rank r's own value of it."""
    bits = 24 if dtype == torch.float32 else 8
    ulp = 2.0 ** (math.frexp(stock)[1] - bits) if stock else 2.0 ** -126
    tolerance = 2 * world_size * sum(map(abs, x)) * 2.0 ** -bits + ulp

    def of(values):  # the reduction of these ranks' values, exact
        if op == "MAX":
            return max(values)
        return sum(values) / (world_size if op == "AVG" else 1)
    if yours == of([x[b]]) and world_size > 1:
        return (f"block {b} is still rank {b}'s own value: it never travelled round the ring."
                f" In W - 1 = {world_size - 1} step(s) each rank combines the partial sum that"
                f" arrives into its copy of the next block; the last step adds into rank b's"
                f" block b: a step short leaves it as it was")
    if op != "MAX" and abs(yours - of(x)) <= tolerance:
        return (f"every rank's value, added in another order: a rounding difference of"
                f" {abs(yours - stock) / ulp:g} unit(s) of the last place. gloo adds block b as"
                f" x_b + (x_(b+1) + (... + x_(b-1))): what arrives from rank + 1 is added to"
                f" this rank's own copy, mine + arrived, and that sum is sent on to rank - 1")
    copied = [k for k in range(world_size) if k != b and yours == of([x[k]])]
    if copied:
        return (f"block {b} holds rank {copied[0]}'s value alone: each step copied what"
                f" arrived over this rank's own copy instead of combining the two,"
                f" mine <- op(mine, arrived)")
    if op == "MAX" and abs(yours - sum(x)) <= tolerance:
        return ("the ranks' values added, not their MAX: combine with the op,"
                " ops.combine(op, mine, arrived), not +")
    for k in range(world_size):
        if abs(yours - of(x[:k] + x[k + 1:])) <= tolerance:
            return (f"the {op} of W - 1 = {world_size - 1} ranks' values: rank {k}'s is"
                    f" missing" + (f", block {b}'s own: what arrives must be combined with"
                                   f" this rank's copy, mine <- op(mine, arrived), not copied"
                                   f" over it" if k == b else
                                   ": a step short, or a block that left before rank"
                                   f" {k} added to it"))
        if op != "MAX" and abs(yours - of(x + [x[k]])) <= tolerance:
            return (f"rank {k}'s value counted twice: a step too many, or a partial sum"
                    f" combined into a block that already held it")
    return (f"a value no reduction of the ranks' values gives (theirs: {x}): blocks mixed up"
            f" (a block index off by one: at step s rank r sends block r + s + 1 and adds"
            f" into block r + s + 2), or a block received into the wrong place")


CHECKS = {"sampler": sampler, "broadcast": broadcast, "pp": pp, "ring": ring}
