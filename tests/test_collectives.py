"""Chapter 0 (minddp/collectives/) against gloo's own collectives, bit for bit.

    pytest tests/test_collectives.py

In the shared spawns of 2, 3 and 4 ranks (and 8, one small case), on random values spread
over 2^-20 .. 2^20 so that another order of additions shows in the bits, in float32,
bfloat16 and float64, at sizes that divide into the ranks and sizes that do not:
- gloo's order: probe values for which each order gives other bits show that gloo's
  all_reduce sums block b (its blocks: all_reduce.gloo_blocks, small and large tensors) as
  x_b + (x_{b+1} + (... + x_{b-1})); its reduce_scatter_tensor sums as it does, its reduce
  too up to 2W MiB, and past it on blocks of whole MiB (ring_reduce.gloo_reduce_blocks):
  gloo's reduce bit for bit there too, on dst.
- every collective `torch.equal` to gloo's on every rank: all_reduce (SUM, AVG, PRODUCT,
  MIN, MAX), broadcast (tree, chain), reduce, all_gather (both forms), reduce_scatter_tensor
  (where gloo's blocks are the pieces: an even size per rank), all_to_all (both forms);
  on the world and on a group without global rank 0; async_op's Work too; a Parameter
  under no_grad (or not), a tensor made in inference_mode; transposed views in place and
  the inputs and outputs of other layouts stock's gloo takes right, in the caller's view.
- the tree and halving-doubling: `torch.equal` to the same additions made in one process in
  their order, and within the textbook bound of gloo's (how far: docs/collectives.md);
  reduce_scatter where gloo's blocks are not the pieces, and the list form: the ring's order.
- bytes each rank sends = cost.sent_bytes, counted at dist.batch_isend_irecv.
- the refusals: one line, on every rank alike; AVG on integers before a byte leaves; the
  layouts stock's gloo gets wrong, with the reason.
- NaiveDDP and BucketedDDP on chapter 0's all_reduce: stock DDP's gradients bit for bit;
  examples/manual_ddp.py --collectives minddp: its table IDENTICAL to stock's at 3 ranks;
  examples/break_collectives.py: each break named, the hang at --timeout.
"""

import contextlib
import math
import re
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import minddp.collectives as mine
from ahead import ahead_torchrun
from helpers import REPO, assert_identical_tables, cli, share_spawn, shared_results, \
    usage_errors
from minddp.bench.collectives import counting_sent
from minddp.collectives import checks, chosen, cost
from minddp.collectives.ring_all_reduce import gloo_blocks

SUM, AVG, PRODUCT, MIN, MAX = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT,
                               dist.ReduceOp.MIN, dist.ReduceOp.MAX)
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
# Probe values: each rotation of the ring's order gives other float32 bits (W = 3, 4).
PROBES = {3: [1.0, 2.0 ** -24, -3 * 2.0 ** -25], 4: [1.0, -1.0, 5 * 2.0 ** -25, 2.0 ** -24]}


def _values(rank, n, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + 17 * rank + n)
    spread = 2.0 ** torch.randint(-20, 21, (n,), generator=g).double()
    return (torch.randn(n, generator=g, dtype=torch.float64) * spread).to(dtype)


def _gathered(x, group=None):
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, x, group=group)
    return everyone


def ring_order(xs, blocks):
    """Block b of the sum as the ring adds it: x_b + (x_{b+1} + (... + x_{b-1})), in one
    process; `blocks`: (start, end) per rank."""
    size, out = len(xs), torch.empty_like(xs[0])
    for b, (start, end) in enumerate(blocks):
        acc = xs[(b - 1) % size][start:end].clone()
        for back in range(2, size + 1):
            acc = xs[(b - back) % size][start:end] + acc
        out[start:end] = acc
    return out


def gloo_layout(n, element_size, size):
    """gloo's ring blocks, from docs/collectives.md's formula: (start, end) per rank."""
    segments = max(-(-n * element_size // 2 ** 20), 2 * size)
    segments = -(-segments // size) * size
    per_block = -(-n // segments) * (segments // size)
    return [(min(n, b * per_block), min(n, (b + 1) * per_block)) for b in range(size)]


def gloo_reduce_layout(n, element_size, size):
    """gloo's reduce blocks, from docs/collectives.md's formula: segments of ceil(n / 2W)
    elements, at most 1 MiB, S/W of them a rank (the all_reduce's S)."""
    segment = min(-(-n // (2 * size)), 2 ** 20 // element_size)
    segments = max(-(-n * element_size // 2 ** 20), 2 * size)
    segments = -(-segments // size) * size
    per_block = segment * (segments // size)
    return [(min(n, b * per_block), min(n, (b + 1) * per_block)) for b in range(size)]


def tree_order(xs):
    """Pairwise, neighbours first: (x0 + x1) + (x2 + x3), in one process."""
    partial, step = [x.clone() for x in xs], 1
    while step < len(partial):
        for r in range(0, len(partial) - step, 2 * step):
            partial[r] = partial[r] + partial[r + step]
        step *= 2
    return partial[0]


def halving_doubling_order(xs):
    """The first 2e ranks folded in pairs (e = W - the largest power of two), then the tree."""
    power = 1 << (len(xs).bit_length() - 1)
    extra = len(xs) - power
    folded = [xs[2 * v] + xs[2 * v + 1] for v in range(extra)] + list(xs[2 * extra:])
    return tree_order(folded)


# ---- gloo's order, found with probe values -------------------------------------------------

def _probe(rank, world_size):
    """{n: {what: verdict}} for small and large n (float32): gloo's all_reduce equals the ring
    order on gloo_layout's blocks, and no other rotation's, at every element; its reduce the
    ring order on gloo_reduce_layout's (other blocks past 2W MiB); ours equal to gloo's."""
    found = {}
    last = world_size - 1
    for n in (7, 10, 2 ** 21 + 5):  # the last: 8 MiB, more than two 1 MiB segments a rank
        x = torch.full((n,), PROBES[world_size][rank])
        theirs, ours = x.clone(), x.clone()
        dist.all_reduce(theirs)
        mine.all_reduce(ours)
        reduced, ours_reduced = x.clone(), x.clone()
        dist.reduce(reduced, dst=last)
        mine.reduce(ours_reduced, dst=last)
        xs = _gathered(x)
        blocks = gloo_layout(n, 4, world_size)
        other = [ring_order(xs, [(0, n) if b == k else (0, 0) for b in range(world_size)])
                 for k in range(world_size)]  # every element summed as block k
        found[n] = {"alone": all(not torch.equal(other[k][:1], other[j][:1])
                                 for k in range(world_size) for j in range(k)),
                    "all_reduce": torch.equal(theirs, ring_order(xs, blocks)),
                    "ours": torch.equal(ours, theirs), "blocks": blocks}
        if rank == last:
            found[n]["reduce"] = torch.equal(
                reduced, ring_order(xs, gloo_reduce_layout(n, 4, world_size)))
            found[n]["ours reduced"] = torch.equal(ours_reduced, reduced)
            found[n]["reduce's blocks are not all_reduce's"] = not torch.equal(reduced, theirs)
    return found


share_spawn(_probe, [3, 4])


@pytest.mark.parametrize("world_size", [3, 4])
def test_gloo_sums_each_block_in_ring_order_and_ours_does_too(world_size):
    for rank, found in enumerate(shared_results(_probe, world_size)):
        for n, seen in found.items():
            assert seen["alone"], "the probe values must tell every rotation apart"
            assert seen["all_reduce"] and seen["ours"], (rank, n, seen)
            if rank == world_size - 1:  # dst: gloo's reduce cuts whole 1 MiB segments
                assert seen["reduce"] and seen["ours reduced"], (rank, n, seen)
                past = n * 4 > 2 * world_size * 2 ** 20
                assert seen["reduce's blocks are not all_reduce's"] == past, (rank, n, seen)


def test_gloo_blocks_are_the_documented_layout():
    # 7 elements on 3 ranks: 4, 3, 0 (not ceil(7/3) = 3 each); 8 MiB + 20 bytes on 3 ranks:
    # 9 segments, 3 a rank, of 233018 elements: blocks of 699054, the last 699049.
    assert [len(b) for b in gloo_blocks(torch.zeros(7), 3)] == [4, 3, 0]
    assert [len(b) for b in gloo_blocks(torch.zeros(2 ** 21 + 5), 3)] == [699054, 699054,
                                                                          699049]
    for n, size in [(7, 3), (10, 4), (1001, 8), (2 ** 21 + 5, 3), (3 * 2 ** 20, 4)]:
        got = gloo_blocks(torch.zeros(n, dtype=torch.bfloat16), size)
        assert [len(b) for b in got] == [e - s for s, e in gloo_layout(n, 2, size)]
    # reduce: 6 MiB + 4 bytes on 3 ranks: 9 segments of 1 MiB (262144 float32), 3 a rank.
    from minddp.collectives.ring_reduce import gloo_reduce_blocks
    assert [len(b) for b in gloo_reduce_blocks(torch.zeros(6 * 2 ** 18 + 1), 3)] == [
        786432, 786432, 1]
    assert [len(b) for b in gloo_reduce_blocks(torch.zeros(7), 3)] == [4, 3, 0]
    for n, size, dtype in [(7, 3, torch.float32), (2, 5, torch.float32),
                           (6 * 2 ** 18, 3, torch.float32), (6 * 2 ** 18 + 1, 3, torch.float32),
                           (2 ** 22 + 3, 4, torch.bfloat16), (5 * 2 ** 19 + 1, 5, torch.float32),
                           (5 * 2 ** 20 + 1, 3, torch.float16), (2 ** 20 + 1, 2, torch.float64)]:
        got = gloo_reduce_blocks(torch.empty(n, dtype=dtype), size)
        layout = gloo_reduce_layout(n, torch.empty(0, dtype=dtype).element_size(), size)
        assert [len(b) for b in got] == [e - s for s, e in layout], (n, size, dtype)


def _gloos_orders(rank, world_size):
    """{(what, n): gloo's result torch.equal to the documented order} on random float32."""
    found = {}
    for n in (5, 8, 1001):
        x = _values(rank, n, torch.float32, seed=4)
        xs = _gathered(x)
        ring = ring_order(xs, gloo_layout(n, 4, world_size))
        summed, averaged, reduced = x.clone(), x.clone(), x.clone()
        dist.all_reduce(summed)
        dist.all_reduce(averaged, op=AVG)
        dist.reduce(reduced, dst=world_size - 1)
        found["all_reduce", n] = torch.equal(summed, ring)
        found["AVG = SUM / W", n] = torch.equal(averaged, ring / world_size)
        if rank == world_size - 1:
            found["reduce", n] = torch.equal(reduced, ring)
        whole = _values(rank, n * world_size, torch.float32, seed=5)
        wholes = _gathered(whole)
        mine_piece = slice(rank * n, (rank + 1) * n)
        out = torch.empty(n)
        dist.reduce_scatter_single(out, whole)
        found["reduce_scatter_tensor", n] = torch.equal(
            out, ring_order(wholes, gloo_layout(n * world_size, 4, world_size))[mine_piece])
        dist.reduce_scatter(out, list(whole.split(n)))  # each piece: an all_reduce of its own
        pieces = [w[mine_piece] for w in wholes]
        found["reduce_scatter (a list)", n] = torch.equal(
            out, ring_order(pieces, gloo_layout(n, 4, world_size)))
    return found


share_spawn(_gloos_orders, [3, 4])


@pytest.mark.parametrize("world_size", [3, 4])
def test_gloos_reductions_all_sum_in_its_all_reduces_order(world_size):
    # reduce (below 2W MiB) and reduce_scatter_tensor: as its all_reduce of the whole tensor;
    # reduce_scatter of a list: as an all_reduce of each piece alone; AVG: the sum, then / W.
    for rank, found in enumerate(shared_results(_gloos_orders, world_size)):
        assert all(found.values()), (rank, {k: v for k, v in found.items() if not v})


# ---- every collective against gloo's, bit for bit ------------------------------------------

def _reductions(rank, group, n, dtype):
    """{case: torch.equal(ours, gloo's)} for the reducing collectives on one input."""
    size = dist.get_world_size(group)
    x, same = _values(rank, n, dtype), {}
    for op in (SUM, AVG, PRODUCT, MIN, MAX):
        theirs, ours = x.clone(), x.clone()
        dist.all_reduce(theirs, op=op, group=group)
        mine.all_reduce(ours, op=op, group=group)
        same[f"all_reduce {op.name}"] = torch.equal(theirs, ours)
    last = dist.get_global_rank(group, size - 1) if group else size - 1
    theirs, ours = x.clone(), x.clone()
    dist.reduce(theirs, dst=last, group=group)
    mine.reduce(ours, dst=last, group=group)
    if dist.get_rank(group) == size - 1:
        same["reduce"] = torch.equal(theirs, ours)
    pieces = [(r * n, (r + 1) * n) for r in range(size)]
    if gloo_layout(n * size, x.element_size(), size) == pieces:  # gloo cuts at the pieces
        whole = _values(rank, n * size, dtype, seed=1)
        theirs, ours = torch.empty_like(x), torch.empty_like(x)
        dist.reduce_scatter_single(theirs, whole, group=group)
        mine.reduce_scatter_tensor(ours, whole, group=group)
        same["reduce_scatter_tensor"] = torch.equal(theirs, ours)
    return same


def _copies(rank, group, n, dtype):
    """{case: torch.equal(ours, gloo's)} for the collectives that only move bits."""
    size = dist.get_world_size(group)
    x, same = _values(rank, n, dtype), {}
    last = dist.get_global_rank(group, size - 1) if group else size - 1
    for name, ours_fn in (("broadcast", mine.broadcast), ("chain", mine.chain_broadcast)):
        theirs, ours = x.clone(), x.clone()
        dist.broadcast(theirs, src=last, group=group)
        ours_fn(ours, src=last, group=group)
        same[name] = torch.equal(theirs, ours)
    theirs, ours = _gathered(x, group), [torch.empty_like(x) for _ in range(size)]
    mine.all_gather(ours, x, group=group)
    same["all_gather"] = all(map(torch.equal, theirs, ours))
    flat = torch.empty(n * size, dtype=dtype)
    mine.all_gather_into_tensor(flat, x, group=group)
    same["all_gather_into_tensor"] = torch.equal(flat, torch.cat(theirs))
    pieces = [_values(rank, n, dtype, seed=2 + r) for r in range(size)]
    expected = [torch.empty(n, dtype=dtype) for _ in range(size)]
    got = [torch.empty_like(t) for t in expected]
    if torch.__version__ >= "2.13":
        dist.all_to_all(expected, pieces, group=group)
    else:  # gloo has no list all_to_all before torch 2.13: the same copies, as one tensor
        whole = torch.empty(n * size, dtype=dtype)
        dist.all_to_all_single(whole, torch.cat(pieces), group=group)
        expected = list(whole.split(n))
    mine.all_to_all(got, pieces, group=group)
    same["all_to_all"] = all(map(torch.equal, expected, got))
    me = dist.get_rank(group)
    splits = [me + peer + 1 for peer in range(size)]  # uneven: rank i sends rank j i + j + 1
    rows = _values(rank, 2 * sum(splits), dtype, seed=3).view(-1, 2)
    theirs, ours = torch.empty_like(rows), torch.empty_like(rows)
    dist.all_to_all_single(theirs, rows, splits, splits, group=group)
    mine.all_to_all_single(ours, rows, splits, splits, group=group)
    same["all_to_all_single"] = torch.equal(theirs, ours)
    return same


def _against_gloo(rank, world_size, subgroup=False):
    """{(n, dtype): {case: equal}} on the world, or on the ranks but global rank 0."""
    group = dist.new_group(list(range(1, world_size))) if subgroup else None
    if subgroup and rank == 0:
        return {}
    size = dist.get_world_size(group)
    sizes = (1, 4 * size, 4 * size + 1, 2 * size + 3, 300_002)  # x 4 B: two chain chunks
    results = {}
    for n in sizes:
        for dtype in DTYPES:
            results[n, str(dtype)] = {**_reductions(rank, group, n, dtype),
                                      **_copies(rank, group, n, dtype)}
    return results


share_spawn(_against_gloo, [2, 3, 4])
share_spawn(_against_gloo, [3, 4], True, key="subgroup")


def _check_all_equal(per_rank, expected_cases):
    for rank, results in enumerate(per_rank):
        for case, same in results.items():
            assert expected_cases <= set(same) or rank == -1, (case, set(same))
            assert all(same.values()), (rank, case, {k: v for k, v in same.items() if not v})


EVERY = {"all_reduce SUM", "all_reduce AVG", "all_reduce PRODUCT", "all_reduce MIN",
         "all_reduce MAX", "broadcast", "chain", "all_gather", "all_gather_into_tensor",
         "all_to_all", "all_to_all_single"}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_collective_is_bitwise_gloos(world_size):
    per_rank = shared_results(_against_gloo, world_size)
    _check_all_equal(per_rank, EVERY)
    last = per_rank[-1]
    assert all("reduce" in same for same in last.values())
    assert sum("reduce_scatter_tensor" in same for same in last.values()) >= 5


@pytest.mark.parametrize("world_size", [3, 4])
def test_every_collective_is_bitwise_gloos_on_a_group_without_rank_0(world_size):
    per_rank = shared_results(_against_gloo, world_size, key="subgroup")
    assert per_rank[0] == {}
    _check_all_equal(per_rank[1:], EVERY)


def _reduce_past_two_mib_a_rank(rank, world_size):
    """{case: verdicts on dst} for reduce just past 2W MiB, where gloo's reduce cuts other
    blocks than its all_reduce: 3 ranks float32 (+ 1 element), 4 ranks bfloat16 (+ 3) and,
    at 4, float16 on the group without global rank 0 (+ 1); dst not group rank 0."""
    cases = {3: [(6 * 2 ** 18 + 1, torch.float32, None, 1)],
             4: [(2 ** 22 + 3, torch.bfloat16, None, 1),
                 (3 * 2 ** 20 + 1, torch.float16, [1, 2, 3], 3)]}[world_size]
    found = {}
    for n, dtype, ranks, dst in cases:
        group = dist.new_group(ranks) if ranks else None
        if ranks and rank not in ranks:
            continue
        x = _values(rank, n, torch.float64, seed=6)
        x = (x * 2.0 ** -8 if dtype == torch.float16 else x).to(dtype)  # (float16: no inf)
        theirs, ours, summed = x.clone(), x.clone(), x.clone()
        dist.reduce(theirs, dst=dst, group=group)
        mine.reduce(ours, dst=dst, group=group)
        dist.all_reduce(summed, group=group)
        case = (n, str(dtype), str(ranks))
        if rank == dst:
            found[case] = {"bitwise gloo's": torch.equal(ours, theirs),
                           "unlike gloo's all_reduce": not torch.equal(theirs, summed)}
        else:
            found[case] = {"left as it was": torch.equal(ours, x)}
    return found


share_spawn(_reduce_past_two_mib_a_rank, [3, 4])


@pytest.mark.parametrize("world_size", [3, 4])
def test_reduce_past_2w_mib_is_bitwise_gloos(world_size):
    # gloo's reduce (gloo/reduce.cc) cuts segments of at most 1 MiB, its all_reduce shares
    # the tensor out evenly over the segments: past 2W MiB the blocks, and the bits, differ.
    per_rank = shared_results(_reduce_past_two_mib_a_rank, world_size)
    assert sum(len(found) for found in per_rank) == (3 if world_size == 3 else 7)
    for rank, found in enumerate(per_rank):
        for case, verdicts in found.items():
            assert all(verdicts.values()), (rank, case, verdicts)


# ---- orders of their own: the tree, halving-doubling, reduce_scatter's pieces ---------------

def _own_orders(rank, world_size):
    """{(algorithm, n, dtype): (torch.equal to its order in one process, elements unlike
    gloo's, the largest difference over the bound 2(W-1) u sum|x|)}."""
    found = {}
    for n in (4 * world_size, 4 * world_size + 1, 1001):
        for dtype in DTYPES:
            x = _values(rank, n, dtype)
            xs, gloos = _gathered(x), x.clone()
            dist.all_reduce(gloos)
            unit = torch.finfo(dtype).eps / 2
            bound = 2 * (world_size - 1) * unit * sum(t.double().abs() for t in xs)
            for name, algorithm, order in (
                    ("tree", mine.tree_all_reduce, tree_order),
                    ("halving-doubling", mine.halving_doubling_all_reduce,
                     halving_doubling_order)):
                ours = x.clone()
                algorithm(ours)
                over = ((ours.double() - gloos.double()).abs() / bound.clamp_min(1e-300)).max()
                found[name, n, str(dtype)] = (torch.equal(ours, order(xs)),
                                              int((ours != gloos).sum()), over.item())
            whole = _values(rank, n * world_size, dtype, seed=1)
            pieces = [(r * n, (r + 1) * n) for r in range(world_size)]
            expected = ring_order(_gathered(whole), pieces)[rank * n:(rank + 1) * n]
            ours, listed = torch.empty_like(x), torch.empty_like(x)
            mine.reduce_scatter_tensor(ours, whole)
            mine.reduce_scatter(listed, list(whole.split(n)))
            found["reduce_scatter", n, str(dtype)] = (
                torch.equal(ours, expected) and torch.equal(listed, expected), 0, 0.0)
    return found


share_spawn(_own_orders, [2, 3, 4])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tree_and_halving_doubling_add_in_their_own_order(world_size):
    for rank, found in enumerate(shared_results(_own_orders, world_size)):
        for case, (own_order, unlike_gloo, over_bound) in found.items():
            assert own_order, (rank, case)
            assert over_bound <= 1.0, (rank, case, over_bound)  # a rounding, nothing worse
            if world_size == 2:  # a + b is b + a: every order is gloo's
                assert unlike_gloo == 0, (rank, case)
        if world_size > 2:  # the orders differ, and it shows in the bits somewhere
            assert any(unlike for (name, *_), (_, unlike, _) in found.items()
                       if name == "tree"), rank


def test_the_tree_and_halving_doubling_share_an_order_at_a_power_of_two():
    xs = [_values(r, 64, torch.float32) for r in range(8)]
    assert torch.equal(tree_order(xs), halving_doubling_order(xs))
    assert not torch.equal(tree_order(xs[:3]), ring_order(xs[:3], [(0, 64), (0, 0), (0, 0)]))


# ---- bytes: counted = the formula -----------------------------------------------------------

def _bytes(rank, world_size):
    """{algorithm: (bytes counted on this rank, cost.sent_bytes)} for 3 MiB of float32,
    and the shape check's own bytes."""
    n = 3 * 2 ** 18  # 3 MiB: 2W equal blocks at W = 2, 3, 4; three chain chunks
    x = torch.ones(n)
    nbytes = n * 4
    calls = {
        "ring all_reduce": lambda: mine.all_reduce(x.clone()),
        "tree all_reduce": lambda: mine.tree_all_reduce(x.clone()),
        "halving-doubling": lambda: mine.halving_doubling_all_reduce(x.clone()),
        "all_gather": lambda: mine.all_gather_into_tensor(
            torch.empty(n), x[:n // world_size]),
        "reduce_scatter": lambda: mine.reduce_scatter_tensor(torch.empty(n // world_size), x),
        "all_to_all": lambda: mine.all_to_all_single(torch.empty(n), x),
        "reduce": lambda: mine.reduce(x.clone(), dst=0),
        "tree broadcast": lambda: mine.broadcast(x.clone(), src=0),
        "chain broadcast": lambda: mine.chain_broadcast(x.clone(), src=0),
        "barrier": lambda: mine.barrier(),
    }
    found = {}
    checks.SAME_SHAPE_CHECKED = False
    try:
        for name, call in calls.items():
            counted = [0]
            with counting_sent(counted):
                call()
            found[name] = (counted[0], cost.sent_bytes(name, nbytes, world_size, rank))
    finally:
        checks.SAME_SHAPE_CHECKED = True
    counted = [0]
    with counting_sent(counted):
        checks.check_same_shape(x, None, "the count")  # (no collective is in flight)
    found["shape check"] = (counted[0], (world_size - 1) * 9 * 8)  # 9 int64 to each peer
    return found


share_spawn(_bytes, [2, 3, 4])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_each_rank_sends_are_the_formula(world_size):
    for rank, found in enumerate(shared_results(_bytes, world_size)):
        for name, (counted, formula) in found.items():
            assert counted == formula, (rank, name, counted, formula)
        ring = found["ring all_reduce"][0]
        assert ring == 2 * (world_size - 1) * 3 * 2 ** 20 // world_size  # 2(W-1)/W N


def test_the_cost_model_counts_steps():
    assert cost.steps("ring all_reduce", 1024, 8) == 14
    assert cost.steps("tree all_reduce", 1024, 8) == 6
    assert cost.steps("halving-doubling", 1024, 8) == 6
    assert cost.steps("halving-doubling", 1024, 3) == 4  # fold, 1 halving, 1 doubling, back
    assert cost.steps("chain broadcast", 2 ** 22, 4) == 4 + 2  # 4 chunks of 1 MiB
    assert cost.path_bytes("ring all_reduce", 800, 8) == 1400


# ---- refusals, async, 8 ranks ---------------------------------------------------------------

def _refusals(rank, world_size):
    x = torch.ones(6)
    subgroup = dist.new_group([1, 2]) if world_size >= 3 else None
    calls = [
        ("premul", lambda: mine.all_reduce(x, op=dist._make_nccl_premul_sum(2.0))),
        ("band", lambda: mine.all_reduce(x, op=dist.ReduceOp.BAND)),
        ("strided", lambda: mine.all_reduce(torch.ones(4, 3)[:, :2])),
        ("list", lambda: mine.all_gather([torch.empty(6)] * (world_size + 1), x)),
        ("sizes", lambda: mine.reduce_scatter_tensor(torch.empty(4), x)),
        ("shapes", lambda: mine.all_reduce(torch.ones(3 + rank))),
        ("dtypes", lambda: mine.broadcast(x.to(torch.float64 if rank else torch.float32))),
        ("after", lambda: mine.all_reduce(x.clone())),  # the group still works after them
    ]
    if subgroup is not None:
        calls.append(("src", lambda: mine.broadcast(x, src=0, group=subgroup)))
    return usage_errors(calls)


share_spawn(_refusals, [2, 3])


@pytest.mark.parametrize("world_size", [2, 3])
def test_mistakes_are_refused_in_one_line_on_every_rank(world_size):
    per_rank = shared_results(_refusals, world_size)
    for rank, said in enumerate(per_rank):
        assert "ReduceOp.PREMUL_SUM" in said["premul"] and "gloo has none" in said["premul"]
        assert "ReduceOp.BAND" in said["band"] and "integer" in said["band"]
        assert "not one dense block of memory (strides (3, 1))" in said["strided"]
        assert f"{world_size + 1} output tensors, expected {world_size}" in said["list"]
        assert "input elements (W times the output's)" in said["sizes"]
        assert said["shapes"] == ("all_reduce: the ranks' tensors differ: group rank 0 has"
                                  " shape [3] (4-byte elements), group rank 1 has shape [4]"
                                  " (4-byte elements) (hint: every rank must pass a tensor"
                                  " of the same shape and dtype)")
        assert "(4-byte elements), group rank 1 has shape [6] (8-byte" in said["dtypes"]
        assert said["after"] is None
        if world_size == 3:
            assert (said["src"] is None) == (rank == 0), said  # rank 0: not in the group
            if rank:
                assert "global rank 0 is not in the group (its global ranks: [1, 2])" \
                    in said["src"]
        assert all("\n" not in text for text in said.values() if text)


def _avg_on_integers(rank, world_size):
    """{call: (what it raised, on this rank, or None; bytes it sent; its tensor unchanged)}
    for ReduceOp.AVG on integer and bool tensors, then whether SUM on one still works."""
    def ints(n, dtype=torch.int64):
        return torch.arange(n, dtype=dtype) + rank

    out = torch.zeros(2, dtype=torch.int64)
    calls = {
        "all_reduce int64": (ints(6), lambda t: mine.all_reduce(t, op=AVG)),
        "all_reduce bool": (ints(6) > 2, lambda t: mine.all_reduce(t, op=AVG)),
        "reduce int32 onto rank 0": (ints(6, torch.int32),
                                     lambda t: mine.reduce(t, dst=0, op=AVG)),
        "reduce uint8 onto rank 2": (ints(6, torch.uint8),
                                     lambda t: mine.reduce(t, dst=2, op=AVG)),
        "reduce_scatter_tensor int64": (ints(2 * world_size),
                                        lambda t: mine.reduce_scatter_tensor(out, t, op=AVG)),
        "reduce_scatter int16": (ints(2, torch.int16), lambda t: mine.reduce_scatter(
            t, [t.clone() for _ in range(world_size)], op=AVG)),
        "tree_all_reduce int64": (ints(6), lambda t: mine.tree_all_reduce(t, op=AVG)),
        "halving_doubling int64": (ints(6), lambda t: mine.halving_doubling_all_reduce(
            t, op=AVG)),
    }
    found = {}
    for name, (tensor, call) in calls.items():
        before, sent, said = tensor.clone(), [0], None
        try:
            with counting_sent(sent):
                call(tensor)
        except Exception as error:  # what stock raises too: a RuntimeError
            said = f"{type(error).__name__}: {error}"
        found[name] = (said, sent[0], torch.equal(tensor, before))
    summed, theirs = ints(6), ints(6)
    mine.all_reduce(summed)
    dist.all_reduce(theirs)
    found["SUM after"] = torch.equal(summed, theirs)
    return found


share_spawn(_avg_on_integers, [3])


def test_avg_on_integers_is_refused_on_every_rank_before_a_byte_leaves():
    # Stock sums, then fails to divide: a RuntimeError on every rank, the tensor left summed.
    for rank, found in enumerate(shared_results(_avg_on_integers, 3)):
        assert found.pop("SUM after") is True
        assert len(found) == 8
        for name, (said, sent, unchanged) in found.items():
            dtype = name.split()[-1] if "onto" not in name else name.split()[1]
            assert said and said.startswith("UsageError: ") and "\n" not in said, (rank, name, said)
            assert f"op=ReduceOp.AVG on a torch.{dtype} tensor" in said, (rank, name, said)
            assert (sent, unchanged) == (0, True), (rank, name, sent, unchanged)


def _stock_all_to_all(outputs, inputs):
    """dist.all_to_all; gloo has none before torch 2.13: the same copies, as one tensor."""
    if torch.__version__ >= "2.13":
        dist.all_to_all(outputs, inputs)
        return
    whole = torch.empty(sum(t.numel() for t in outputs))
    dist.all_to_all_single(whole, torch.cat([t.reshape(-1) for t in inputs]))
    for out, piece in zip(outputs, whole.split([t.numel() for t in outputs])):
        out.copy_(piece.view(out.shape))


def _layouts(rank, world_size):
    """{case: [verdicts]} for the layouts stock's gloo takes and gets right: ours torch.equal
    to stock's same call, written into the caller's view, the elements beside it untouched;
    and {case: the refusal} for those stock gets wrong or crashes on (not called on stock)."""
    size = world_size

    def made(layout, shape, seed):
        """A tensor of `shape` (2-D), this rank's values, laid out as `layout` says."""
        n = math.prod(shape)
        x = _values(rank, 2 * n, torch.float32, seed=seed)
        return {"transposed": lambda: x[:n].view(shape[::-1]).t(),
                "strided": lambda: x[::2].view(shape),  # every other element
                "expanded": lambda: x[:1].expand(shape),  # one element, n times
                "contiguous": lambda: x[:n].view(shape)}[layout]()

    def output(layout, shape):
        """An empty output of `shape`, laid out as `layout` says; strided: its storage's other
        elements hold -7 (untouched() checks them)."""
        return {"transposed": lambda: torch.empty(shape[::-1]).t(),
                "strided": lambda: torch.full((2 * math.prod(shape),), -7.0)[::2].view(shape),
                "expanded": lambda: torch.empty(1).expand(shape)}[layout]()

    def untouched(layout, tensors):
        return layout != "strided" or all(torch.equal(t._base[1::2], torch.full_like(
            t._base[1::2], -7.0)) for t in tensors)

    same = {}
    shape = (4, 5)
    dense = {"transposed": (_values(rank, 60, torch.float32, seed=9).view(10, 6),
                            lambda base: base.t()),
             "permuted": (_values(rank, 60, torch.float32, seed=9).view(3, 4, 5),
                          lambda base: base.permute(2, 0, 1))}
    for layout, (base, view) in dense.items():  # in place: dense, only not in row order
        for name, call in (("all_reduce", lambda lib, t: lib.all_reduce(t)),
                           ("all_reduce AVG", lambda lib, t: lib.all_reduce(t, op=AVG)),
                           ("reduce", lambda lib, t: lib.reduce(t, dst=1)),
                           ("broadcast", lambda lib, t: lib.broadcast(t, src=2))):
            theirs, ours = view(base.clone()), view(base.clone())
            pointer, strides = ours.data_ptr(), ours.stride()
            call(dist, theirs)
            call(mine, ours)
            if name != "reduce" or rank == 1:
                same[f"{name} of a {layout} view"] = [
                    torch.equal(ours, theirs), ours.data_ptr() == pointer,
                    ours.stride() == strides]
        logical, in_memory = view(base).contiguous(), base.clone()
        dist.all_reduce(logical)
        dist.all_reduce(in_memory)
        same[f"gloo's all_reduce sums a {layout} view in memory order"] = [
            not torch.equal(logical, view(in_memory).contiguous())]  # (the cut shows)
        for name, call in (("tree_all_reduce", mine.tree_all_reduce),
                           ("halving_doubling", mine.halving_doubling_all_reduce),
                           ("chain_broadcast", mine.chain_broadcast)):
            ours, in_memory = view(base.clone()), base.clone()
            call(ours)
            call(in_memory)  # the same memory, as a contiguous tensor: in its own order
            same[f"{name} of a {layout} view"] = [torch.equal(ours, view(in_memory))]
    for layout in ("transposed", "strided", "expanded"):  # inputs: read, never written
        x = made(layout, shape, 10)
        theirs, ours = [torch.empty(shape) for _ in range(size)], [torch.empty(shape)
                                                                   for _ in range(size)]
        dist.all_gather(theirs, x)
        mine.all_gather(ours, x)
        same[f"all_gather of {layout} input"] = [all(map(torch.equal, ours, theirs))]
        theirs, ours = torch.empty(size * 4, 5), torch.empty(size * 4, 5)
        dist.all_gather_into_tensor(theirs, x)
        mine.all_gather_into_tensor(ours, x)
        same[f"all_gather_into_tensor of {layout} input"] = [torch.equal(ours, theirs)]
        pieces = [made(layout, shape, 20 + r) for r in range(size)]
        theirs, ours = [torch.empty(shape) for _ in range(size)], [torch.empty(shape)
                                                                   for _ in range(size)]
        _stock_all_to_all(theirs, pieces)
        mine.all_to_all(ours, pieces)
        same[f"all_to_all of {layout} inputs"] = [all(map(torch.equal, ours, theirs))]
        whole = made(layout, (size * 4, 5), 11)
        theirs, ours, row_order = torch.empty(shape), torch.empty(shape), torch.empty(shape)
        dist.reduce_scatter_tensor(theirs, whole)
        mine.reduce_scatter_tensor(ours, whole)
        mine.reduce_scatter_tensor(row_order, whole.contiguous())
        # ours sums any input in its rows' order, round the ring: gloo's bits where its
        # blocks are the pieces, as here, but for a transposed input (it sums memory order)
        same[f"reduce_scatter_tensor of {layout} input"] = [torch.equal(ours, row_order)]
        if layout != "transposed":
            same[f"reduce_scatter_tensor of {layout} input"].append(torch.equal(ours, theirs))
        if layout != "transposed":  # a list: gloo sums a piece as its all_reduce of it, ours
            # round the ring (each order proved above); each as on contiguous pieces here
            got = [torch.empty(shape) for _ in range(4)]
            dist.reduce_scatter(got[0], pieces)
            dist.reduce_scatter(got[1], [piece.contiguous() for piece in pieces])
            mine.reduce_scatter(got[2], pieces)
            mine.reduce_scatter(got[3], [piece.contiguous() for piece in pieces])
            same[f"reduce_scatter of {layout} inputs"] = [torch.equal(got[0], got[1]),
                                                          torch.equal(got[2], got[3])]
    for layout in ("transposed", "strided"):  # outputs: written where they lie
        x = made("contiguous", shape, 12)
        pieces = [made("contiguous", shape, 30 + r) for r in range(size)]
        theirs, ours = [torch.empty(shape) for _ in range(size)], [output(layout, shape)
                                                                   for _ in range(size)]
        dist.all_gather(theirs, x)
        mine.all_gather(ours, x)
        same[f"all_gather into {layout} outputs"] = [all(map(torch.equal, ours, theirs)),
                                                     untouched(layout, ours)]
        theirs, ours = torch.empty(size * 4, 5), output(layout, (size * 4, 5))
        dist.all_gather_into_tensor(theirs, x)
        mine.all_gather_into_tensor(ours, x)
        same[f"all_gather_into_tensor into a {layout} output"] = [torch.equal(ours, theirs),
                                                                  untouched(layout, [ours])]
        theirs, ours = [torch.empty(shape) for _ in range(size)], [output(layout, shape)
                                                                   for _ in range(size)]
        _stock_all_to_all(theirs, pieces)
        mine.all_to_all(ours, pieces)
        same[f"all_to_all into {layout} outputs"] = [all(map(torch.equal, ours, theirs)),
                                                     untouched(layout, ours)]
        whole = made("contiguous", (size * 4, 5), 13)
        theirs, ours = torch.empty(shape), output(layout, shape)
        dist.reduce_scatter_tensor(theirs, whole)
        mine.reduce_scatter_tensor(ours, whole)
        same[f"reduce_scatter_tensor into a {layout} output"] = [torch.equal(ours, theirs),
                                                                 untouched(layout, [ours])]
    refusals = []
    for layout in ("strided", "expanded"):
        x = made(layout, shape, 14)
        refusals += [(f"all_reduce of {layout} view", lambda x=x: mine.all_reduce(x)),
                     (f"reduce of {layout} view", lambda x=x: mine.reduce(x, dst=1)),
                     (f"broadcast of {layout} view", lambda x=x: mine.broadcast(x)),
                     (f"tree_all_reduce of {layout} view",
                      lambda x=x: mine.tree_all_reduce(x)),
                     (f"halving_doubling of {layout} view",
                      lambda x=x: mine.halving_doubling_all_reduce(x)),
                     (f"chain_broadcast of {layout} view",
                      lambda x=x: mine.chain_broadcast(x))]
    ok = made("contiguous", shape, 15)
    for layout in ("transposed", "strided", "expanded"):
        out = output(layout, shape) if layout != "expanded" else made(layout, shape, 16)
        refusals += [(f"reduce_scatter into {layout} output",
                      lambda out=out: mine.reduce_scatter(out, [ok] * size)),
                     (f"all_to_all_single of {layout} input",
                      lambda layout=layout: mine.all_to_all_single(
                          torch.empty(size * 4, 5), made(layout, (size * 4, 5), 17))),
                     (f"all_to_all_single into {layout} output",
                      lambda layout=layout: mine.all_to_all_single(
                          output(layout, (size * 4, 5)) if layout != "expanded" else
                          made(layout, (size * 4, 5), 18), ok.repeat(size, 1)))]
    refusals += [("reduce_scatter of transposed inputs", lambda: mine.reduce_scatter(
        torch.empty(shape), [made("transposed", shape, 19)] * size))]
    expanded = made("expanded", shape, 20)
    refusals += [
        ("all_gather into an expanded output", lambda: mine.all_gather([expanded] * size, ok)),
        ("all_gather_into_tensor into an expanded output", lambda: mine.all_gather_into_tensor(
            made("expanded", (size * 4, 5), 21), ok)),
        ("reduce_scatter_tensor into an expanded output", lambda: mine.reduce_scatter_tensor(
            expanded, ok.repeat(size, 1))),
        ("all_to_all into expanded outputs", lambda: mine.all_to_all([expanded] * size,
                                                                      [ok] * size))]
    return same, usage_errors(refusals)


share_spawn(_layouts, [3])


def test_layouts_stock_takes_right_give_stocks_bits_in_the_callers_view():
    # Transposed and permuted views, in place: gloo sums them in memory order, and so do we.
    # Any layout as an input; transposed and strided outputs, written where they lie.
    for rank, (same, _) in enumerate(shared_results(_layouts, 3)):
        assert len(same) == 38 - (rank != 1) * 2, sorted(same)
        for case, verdicts in same.items():
            assert all(verdicts), (rank, case, verdicts)


def test_layouts_stock_gets_wrong_are_refused_with_the_reason():
    for rank, (_, said) in enumerate(shared_results(_layouts, 3)):
        assert len(said) == 26, sorted(said)
        for case, text in said.items():
            assert text and "\n" not in text, (rank, case, text)
            if case.endswith(("strided view", "expanded view")):
                assert "not one dense block" in text or "share" in text, (case, text)
            elif "expanded output" in case:
                assert "more than one element" in text, (case, text)
            elif case.startswith("all_to_all_single"):
                assert "not contiguous" in text, (case, text)
            else:  # reduce_scatter
                assert "gloo" in text, (case, text)


def _async(rank, world_size):
    """Async calls, all in flight together, each torch.equal to the same call blocking."""
    xs = [_values(rank, n, torch.float32, seed=n) for n in (5, 300, 4097)]
    calls = [mine.all_reduce, mine.tree_all_reduce, mine.halving_doubling_all_reduce]
    blocking = [x.clone() for x in xs]
    for call, x in zip(calls, blocking):
        call(x)
    flying = [x.clone() for x in xs]
    works = [call(x, async_op=True) for call, x in zip(calls, flying)]
    gathered = [torch.empty(5) for _ in range(world_size)]
    last = mine.all_gather(gathered, xs[0], async_op=True)
    values = [w.get_future().wait()[0] for w in works]
    return {"waited": [w.wait() for w in works + [last]] == [True] * 4,
            "done": all(w.is_completed() for w in works + [last]),
            "same": all(map(torch.equal, blocking, flying)),
            "future": all(v is f for v, f in zip(values, flying)),
            "gathered": all(map(torch.equal, gathered, _gathered(xs[0])))}


share_spawn(_async, [3])


def test_async_op_returns_a_work_that_wait_ends():
    for rank, seen in enumerate(shared_results(_async, 3)):
        assert all(seen.values()), (rank, seen)


def _grad_modes(rank, world_size):
    """{case: (ours torch.equal to stock's, in the caller's tensor)} for what autograd's
    modes may hand a collective: a Parameter (under no_grad, or not), a tensor made in
    inference_mode (there, or outside it); or the error the call raised."""
    x = _values(rank, 12, torch.float32, seed=7)
    whole = _values(rank, 12 * world_size, torch.float32, seed=8)

    def param(t):
        return torch.nn.Parameter(t.clone())

    def inference(t):
        with torch.inference_mode():
            return t.clone()

    def all_reduce(lib, t):
        lib.all_reduce(t)
        return t

    def reduce(lib, t):
        lib.reduce(t, dst=1)
        return t if rank == 1 else torch.zeros(0)  # (stock's other ranks: unspecified)

    def broadcast(lib, t):
        lib.broadcast(t, src=2)
        return t

    def scatter_into(lib, t):
        lib.reduce_scatter_tensor(t, whole)
        return t

    def scatter_of(lib, t):
        out = torch.empty(12)
        lib.reduce_scatter_tensor(out, t)
        return out

    def gather_into(lib, t):
        lib.all_gather_into_tensor(t, x)
        return t

    no_grad, grad_on, inference_mode = torch.no_grad, contextlib.nullcontext, torch.inference_mode
    calls = {  # name: (the mode the call runs in, how its tensor is made, the call)
        "all_reduce a Parameter under no_grad": (no_grad, partial(param, x), all_reduce),
        "all_reduce a Parameter, grad on": (grad_on, partial(param, x), all_reduce),
        "all_reduce in inference_mode": (inference_mode, partial(inference, x), all_reduce),
        "all_reduce an inference tensor outside": (grad_on, partial(inference, x), all_reduce),
        "reduce a Parameter under no_grad": (no_grad, partial(param, x), reduce),
        "broadcast a Parameter under no_grad": (no_grad, partial(param, x), broadcast),
        "reduce_scatter_tensor into a Parameter": (no_grad, partial(param, x), scatter_into),
        "reduce_scatter_tensor of a Parameter": (no_grad, partial(param, whole), scatter_of),
        "all_gather_into_tensor into a Parameter": (no_grad, partial(param, whole), gather_into),
    }
    found = {}
    for name, (mode, make, call) in calls.items():
        theirs, ours = make(), make()
        pointer = ours.data_ptr()
        try:
            with mode():
                expected = call(dist, theirs)
                got = call(mine, ours)
            found[name] = (torch.equal(got.detach(), expected.detach()),
                           ours.data_ptr() == pointer and type(ours) is type(theirs))
        except Exception as error:  # (each rank fails alike: no peer is left waiting)
            found[name] = f"{type(error).__name__}: {error}"
    ours, theirs = param(x), x.clone()
    with torch.no_grad():  # async: the mode of the call, not of the wait
        dist.all_reduce(theirs)
        work = mine.all_reduce(ours, async_op=True)
    try:
        work.wait()
        found["async under no_grad, waited outside"] = (torch.equal(ours.detach(), theirs),
                                                        True)
    except Exception as error:
        found["async under no_grad, waited outside"] = f"{type(error).__name__}: {error}"
    return found


share_spawn(_grad_modes, [3])


def test_parameters_and_inference_tensors_reduce_as_stocks():
    # Stock's collectives run in C++, out of autograd's sight; chapter 0's run on a thread
    # of its own, whatever the caller's grad mode or inference mode.
    for rank, found in enumerate(shared_results(_grad_modes, 3)):
        assert len(found) == 10, found
        for case, verdict in found.items():
            assert verdict == (True, True), (rank, case, verdict)


def _eight(rank, world_size):
    """The small case at 8 ranks: the ring bit for bit gloo's, the tree and halving-doubling
    their own order, all_gather and reduce_scatter gloo's."""
    same = {}
    for n in (1, 33, 1001):
        for dtype in (torch.float32, torch.bfloat16):
            x = _values(rank, n, dtype)
            xs, theirs = _gathered(x), x.clone()
            dist.all_reduce(theirs)
            ours, tree, halving = x.clone(), x.clone(), x.clone()
            mine.all_reduce(ours)
            mine.tree_all_reduce(tree)
            mine.halving_doubling_all_reduce(halving)
            gathered = torch.empty(n * 8, dtype=dtype)
            mine.all_gather_into_tensor(gathered, x)
            same[n, str(dtype)] = [torch.equal(ours, theirs), torch.equal(tree, tree_order(xs)),
                                   torch.equal(halving, tree_order(xs)),
                                   torch.equal(gathered, torch.cat(xs))]
    whole = _values(rank, 8 * 6, torch.float32, seed=1)
    theirs, ours = torch.empty(6), torch.empty(6)
    dist.reduce_scatter_single(theirs, whole)
    mine.reduce_scatter_tensor(ours, whole)
    same["reduce_scatter_tensor"] = [torch.equal(theirs, ours)]
    return same


share_spawn(_eight, [8])


def test_eight_ranks_in_one_small_case():
    for rank, same in enumerate(shared_results(_eight, 8)):
        for case, verdicts in same.items():
            assert all(verdicts), (rank, case, verdicts)


# ---- the DDP lessons on chapter 0's all_reduce ----------------------------------------------

def _train(wrap, rank, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.module.parameters()])
        opt.step()
    return grads


def _ddp(rank, world_size):
    from minddp import BucketedDDP, NaiveDDP
    runs = {"stock": _train(lambda m: DDP(m, bucket_cap_mb=0.001), rank),
            "naive torch": _train(NaiveDDP, rank)}
    chosen.use("minddp")
    try:
        runs["bucketed minddp"] = _train(lambda m: BucketedDDP(m, bucket_cap_mb=0.001), rank)
        runs["naive minddp"] = _train(NaiveDDP, rank)
    finally:
        chosen.use("torch")
    same = lambda a, b: all(map(torch.equal, sum(runs[a], []), sum(runs[b], [])))  # noqa: E731
    return {"bucketed = stock": same("bucketed minddp", "stock"),
            "naive = naive on torch's": same("naive minddp", "naive torch")}


share_spawn(_ddp, [2, 3, 4])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_ddp_lessons_on_chapter_0_give_stocks_gradients(world_size):
    for rank, seen in enumerate(shared_results(_ddp, world_size)):
        assert all(seen.values()), (rank, seen)


MANUAL, STOCK = REPO / "examples" / "manual_ddp.py", REPO / "examples" / "stock_ddp.py"


def test_manual_ddp_with_collectives_minddp_is_identical_to_stock(launch):
    _, ours = launch(MANUAL, 3, "--collectives", "minddp")
    _, stock = launch(STOCK, 3)
    assert_identical_tables(ours, stock, 3, steps=3)


BREAKS = ahead_torchrun(2, REPO / "examples" / "break_collectives.py", "--break", "all",
                        "--timeout", "3")


def test_break_collectives_names_each_break_and_the_hang():
    result = BREAKS.result()
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "--break none: every rank equal to gloo's all_reduce, bit for bit" in out
    assert re.search(r"--break off-by-one: \d+ of \d+ elements differ from gloo's", out), out
    assert re.search(r"--break stay-home: rank \d's piece is its own input", out), out
    # Both ranks end up in a send the other never receives (rank 1 one step later); whose
    # timeout runs out first is a race: that one names its send, the other sees it leave.
    assert re.search(r"rank ([01]) stuck in send to rank (?!\1)[01] after 3 s: Timed out",
                     out), out
    assert not re.search(r"from rank  |to rank  ", out), out  # every line names its peer


def test_the_benchmark_counts_the_formulas_bytes_and_fits_the_model(tmp_path):
    # 2 ranks, 1 KiB and 16 KiB, one round: every algorithm's bytes (counted) = the formula;
    # the fit and the picture come out. (No time is asserted: only what is counted.)
    picture = tmp_path / "c.png"
    result = cli("collectives-bench", "--world-sizes", "2",
                 "--sizes", "1K", "16K", "--rounds", "1", "--png", picture)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines()
            if re.match(r"2 +(1K|16K) ", line)]
    assert len(rows) == 2 * 14, result.stdout
    counted = [row for row in rows if not row[3] == "gloo" and len(row) >= 8]
    assert len(counted) == 2 * 9, rows
    assert all(row[-1] == row[-2] for row in counted), counted  # counted = formula
    assert "the alpha-beta fit" in result.stdout and picture.exists()
