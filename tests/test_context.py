"""Context parallelism (minddp/cp/ring_attention.py, context_parallel.py) against stock's ring, one process.

    pytest tests/test_context.py

Attention alone, at 2 and 4 ranks, causal and not, in order and zig-zag, both kernels:
each rank's output and its q, k, v gradients `torch.equal` to the one-process reference
(tests/context_reference.py: every rank's blocks in the ring's order, from the positions
alone) and to stock's private ring (_templated_ring_attention and its backward, with the
CPU kernel) wherever stock takes the case (it refuses zig-zag without a causal mask); the
reference itself within docs/context.md's bound of whole-sequence SDPA.
Float64 q, k, v: `torch.equal` to stock's ring. Zig-zag without a mask at 2, 3 and 4 ranks:
`torch.equal` to stock's plain ring (no load balancing) on the same zig-zag shards, as a
query without a mask sees every key wherever it sits.
The small GPT under context_parallel, 3 AdamW steps: every rank's loss, every mean gradient
and every weight `torch.equal` to the one-process model (a replica per rank, attention by
the reference), at cp=2 under minddp's fully_shard, cp=4 and dp=2 x cp=2 with the gradients
added in rank order on both sides (gloo's own order is not rank order at 4); and dp=2 x cp=2
under fully_shard over all four, minddp's everything against stock's everything. In
float64 at cp=2, one step: each rank's loss and gradients `torch.equal` to stock's ring's.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import context_reference as ref
from helpers import share_spawn, shared_results
from minddp.cp.blockwise import by_hand, fused
from minddp.cp.ring_attention import ring_attention
from minddp.grader.checks.ring_attention import _parts  # each rank's q, k, v, dout, gathered
from minddp.references.stock_context import stock_ring

CASES = [(False, False), (True, False), (True, True), (False, True)]  # (causal, zigzag)
IDS = ["full", "causal", "causal-zigzag", "full-zigzag"]


def _inputs(world_size, seed, length_per_rank=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, length_per_rank * world_size, 8, generator=g).to(dtype)
            for _ in range(4)]  # q, k, v, and the output's gradient


# (batch, heads, tokens per rank, head_dim), dtype: merged in float32 whatever the inputs
SHAPES = [((2, 3, 8, 8), torch.float32), ((1, 2, 6, 16), torch.float32),
          ((2, 2, 4, 8), torch.bfloat16)]


def _ring(parts, rank, causal, zigzag, kernel):
    q, k, v = (t[rank].clone().requires_grad_() for t in parts[:3])
    out = ring_attention(q, k, v, None, causal, zigzag, kernel)
    out.backward(parts[3][rank])
    return [out.detach(), q.grad, k.grad, v.grad]


def _reference(parts, rank, causal, zigzag, kernel):
    qs, ks, vs = ([t.clone().requires_grad_() for t in what] for what in parts[:3])
    outs = ref.reference_attention(qs, ks, vs, causal, zigzag, kernel)
    torch.autograd.backward(outs, parts[3])
    return [outs[rank].detach(), qs[rank].grad, ks[rank].grad, vs[rank].grad]


def _stock(parts, rank, causal, zigzag):
    q, k, v, dout = (t[rank] for t in parts)
    return stock_ring(q, k, v, dout, dist.group.WORLD, causal, zigzag)


def _attention(rank, world_size):
    """{(causal, zigzag, kernel, shape): {against: [out, dq, dk, dv] each torch.equal?}}."""
    verdicts = {}
    for shape_index, (shape, dtype) in enumerate(SHAPES):
        parts = _parts(rank, world_size, 100 * shape_index, shape, dtype)
        for causal, zigzag in CASES:
            for kernel in ("fused", "by_hand"):
                ours = _ring(parts, rank, causal, zigzag, kernel)
                against = {"reference": _reference(parts, rank, causal, zigzag, kernel)}
                if kernel == "fused" and (causal or not zigzag):  # stock refuses the other
                    against["stock"] = _stock(parts, rank, causal, zigzag)
                verdicts[causal, zigzag, kernel, shape_index] = {
                    name: [torch.equal(a, b) for a, b in zip(ours, theirs)]
                    for name, theirs in against.items()}
    return verdicts


share_spawn(_attention, [2, 4])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal,zigzag", CASES, ids=IDS)
@pytest.mark.parametrize("kernel", ["fused", "by_hand"])
def test_ring_attention_is_bitwise_the_reference_and_stocks_ring(world_size, causal, zigzag,
                                                                  kernel):
    for rank, verdicts in enumerate(shared_results(_attention, world_size)):
        for shape in range(len(SHAPES)):
            seen = verdicts[causal, zigzag, kernel, shape]
            assert seen["reference"] == [True] * 4, (rank, SHAPES[shape], seen)
            if kernel == "fused" and (causal or not zigzag):
                assert seen["stock"] == [True] * 4, (rank, SHAPES[shape], seen)
            else:
                assert "stock" not in seen


def _same(ours, theirs):
    """[out, dq, dk, dv]: each torch.equal and of the same dtype (equal() alone promotes)."""
    return [a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs)]


def _float64(rank, world_size):
    """Float64 q, k, v, fused kernel: {(causal, zigzag): _same as stock's ring}, every case
    stock takes (tests/context_reference.py hands the kernel a float32 lse: not compared)."""
    parts = _parts(rank, world_size, 300, (2, 3, 8, 8), torch.float64)
    return {(causal, zigzag): _same(_ring(parts, rank, causal, zigzag, "fused"),
                                    _stock(parts, rank, causal, zigzag))
            for causal, zigzag in CASES if causal or not zigzag}


share_spawn(_float64, [2, 4])


@pytest.mark.parametrize("world_size", [2, 4])
def test_float64_ring_attention_is_bitwise_stocks_ring(world_size):
    for rank, verdicts in enumerate(shared_results(_float64, world_size)):
        assert len(verdicts) == 3, verdicts
        for case, seen in verdicts.items():
            assert seen == [True] * 4, (rank, case, seen)


def _full_zigzag(rank, world_size):
    """Zig-zag without a mask, every shape of SHAPES: [out, dq, dk, dv] _same as stock's
    plain ring (no load balancing) on the same zig-zag shards of one whole sequence."""
    verdicts = []
    for index, (shape, dtype) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(200 + index)  # one sequence, the same on every rank
        b, h, t, d = shape
        whole = [torch.randn(b, h, t * world_size, d, generator=g).to(dtype) for _ in range(4)]
        parts = [[ref.part(x, 2, r, world_size, True) for r in range(world_size)] for x in whole]
        # Without a mask a query sees every key wherever it sits: the zig-zag shards are
        # just W blocks of keys to stock's plain ring, visited in the same order as ours.
        verdicts.append(_same(_ring(parts, rank, False, True, "fused"),
                              _stock(parts, rank, False, False)))
    return verdicts


share_spawn(_full_zigzag, [2, 3, 4])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_full_zigzag_is_bitwise_stocks_plain_ring_on_the_same_shards(world_size):
    for rank, verdicts in enumerate(shared_results(_full_zigzag, world_size)):
        assert verdicts == [[True] * 4] * len(SHAPES), (rank, verdicts)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal,zigzag", CASES, ids=IDS)
def test_the_reference_is_whole_sequence_sdpa_within_the_bound(world_size, causal, zigzag):
    for seed in range(3):
        q, k, v, dout = _inputs(world_size, seed)
        q = q * (1 + 2 * seed)  # sharper softmaxes: larger scores, lse far apart
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        parts = [[ref.part(t, 2, r, world_size, zigzag) for r in range(world_size)]
                 for t in (q, k, v)]
        outs, _ = ref.forward(*parts, causal, zigzag)
        error = max((o - ref.part(whole, 2, r, world_size, zigzag)).abs().max().item()
                    for r, o in enumerate(outs))
        limit = ref.bound(q, k, v, world_size, zigzag)
        assert 0 < error <= limit, (seed, error, limit)  # 0: the reference is not SDPA itself


def test_the_two_kernels_agree_with_whole_sdpa():
    # One block, both kernels: the same (out, lse) as SDPA's within float32 rounding.
    q, k, v, _ = _inputs(1, 0)
    for causal in (False, True):
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for attend in (by_hand, fused):
            out, lse = attend(q, k, v, causal, None)
            assert torch.allclose(out, whole, atol=2e-6, rtol=0), (attend.__name__, causal)
            scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5
            if causal:
                scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1),
                                            float("-inf"))
            assert torch.allclose(lse, scores.logsumexp(-1), atol=2e-6, rtol=0)


TOKENS, BATCH = 16, 2  # per sequence; sequences per dp rank


def _batches(dp, steps=3, seed=5):
    """batches[step][dp_index]: (tokens, targets), each token predicting the next."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        step = []
        for _ in range(dp):
            tokens = torch.randint(0, 32, (BATCH, TOKENS + 1), generator=g)
            step.append((tokens[:, :-1].clone(), tokens[:, 1:].clone()))
        batches.append(step)
    return batches


def _whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _gpt(rank, world_size, dp, zigzag, reduce, impl):
    """The small GPT, 3 AdamW steps under `impl`'s context_parallel on a (dp, cp) mesh, its
    gradients averaged by fully_shard over every rank or in rank order (`reduce`); and the
    one-process model on the same batches. (losses, gradients, weights) of both."""
    from minddp.bench.transformer import gpt
    from minddp.references.libraries import LIBRARIES
    lib, cp = LIBRARIES[impl], world_size // dp
    mesh = lib.init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    model = gpt(tokens=TOKENS)
    one_process = copy.deepcopy(model)
    if reduce == "fsdp":  # torchtitan's: the weights sharded over dp and cp together
        lib.fully_shard(model, mesh=lib.init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    batches, losses, grads = _batches(dp), [], []
    for step in batches:
        tokens, targets = (t.clone() for t in step[rank // cp])
        optimizer.zero_grad()
        with lib.context_parallel(mesh["cp"], buffers=[tokens, targets, model[0].positions],
                                  buffer_seq_dims=[1, 1, 0], zigzag=zigzag):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
        if reduce == "ordered":
            for p in model.parameters():
                each = [torch.empty_like(p.grad) for _ in range(world_size)]
                dist.all_gather(each, p.grad)
                p.grad = ref.ordered_mean(each)
        losses.append(loss.item())
        grads.append([_whole(p.grad) for p in model.parameters()])
        optimizer.step()
    ours = losses, grads, [_whole(p) for p in model.parameters()]
    seen = ref.one_process_gpt(one_process, batches, cp, dp, zigzag)
    theirs = ([s[0][rank] for s in seen], [s[1] for s in seen],
              [_whole(p) for p in one_process.parameters()])
    return ours, theirs


GPT_CASES = {2: [(1, True, "fsdp", "manual"), (1, False, "fsdp", "manual"),
                 (1, True, "fsdp", "stock")],
             4: [(1, True, "ordered", "manual"), (2, True, "ordered", "manual"),
                 (2, False, "ordered", "manual"), (2, True, "fsdp", "manual"),
                 (2, True, "fsdp", "stock")]}
for _size, _cases in GPT_CASES.items():
    for _case in _cases:
        share_spawn(_gpt, [_size], *_case, key="-".join(map(str, _case)))


def _equal(a, b):
    (losses, grads, weights), (losses_b, grads_b, weights_b) = a, b
    differ = [] if losses == losses_b else ["losses"]
    differ += [f"step {s} gradient {i}" for s, (g, h) in enumerate(zip(grads, grads_b))
               for i, (x, y) in enumerate(zip(g, h)) if not torch.equal(x, y)]
    return differ + [f"weight {i}" for i, (x, y) in enumerate(zip(weights, weights_b))
                     if not torch.equal(x, y)]


@pytest.mark.parametrize("world_size,case", [(w, c) for w, cs in GPT_CASES.items() for c in cs
                                             if c[2] == "ordered" or w == 2],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_the_gpt_under_context_parallel_is_the_one_process_model(world_size, case):
    for rank, (ours, one_process) in enumerate(
            shared_results(_gpt, world_size, key="-".join(map(str, case)))):
        assert _equal(ours, one_process) == [], rank


def test_cp_with_fully_shard_on_2x2_is_stocks():
    manual = shared_results(_gpt, 4, key="2-True-fsdp-manual")
    stock = shared_results(_gpt, 4, key="2-True-fsdp-stock")
    for rank in range(4):
        assert _equal(manual[rank][0], stock[rank][0]) == [], rank
        assert manual[rank][0][0][0] > 0  # a loss was trained


def _gpt_float64(rank, world_size, impl):
    """The small GPT in float64, one step under `impl`'s context_parallel (cp=2, zig-zag):
    [this rank's loss, its own gradients] (not averaged: the ring alone is compared)."""
    from minddp.bench.transformer import gpt
    from minddp.references.libraries import LIBRARIES
    lib = LIBRARIES[impl]
    mesh = lib.init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    model = gpt(tokens=TOKENS).double()
    tokens, targets = (t.clone() for t in _batches(1, steps=1)[0][0])
    with lib.context_parallel(mesh["cp"], buffers=[tokens, targets, model[0].positions],
                              buffer_seq_dims=[1, 1, 0]):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


for _impl in ("manual", "stock"):
    share_spawn(_gpt_float64, [2], _impl, key=_impl)


def test_a_float64_gpt_under_context_parallel_is_stocks():
    manual = shared_results(_gpt_float64, 2, key="manual")
    stock = shared_results(_gpt_float64, 2, key="stock")
    for rank in range(2):
        assert manual[rank][0].dtype == torch.float64
        assert _same(manual[rank], stock[rank]) == [True] * len(manual[rank]), rank
