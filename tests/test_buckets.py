"""BucketedDDP and ManualDDP against stock DDP: same buckets, same bits, same no_sync.

    pytest tests/test_buckets.py
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import run_ranks, share_spawn, shared_results
from minddp import BucketedDDP, ManualDDP, NeuralNetwork
from minddp.ddp.bucket_layout import MB, assign_buckets, bucket_size_limits


def _lesson_model():
    return NeuralNetwork(num_inputs=2, num_outputs=2)


def _big_mlp():
    # 3.4M parameters, 13.6 MB of float32: two buckets at stock's defaults (1 MB first,
    # then up to 25 MB), four at bucket_cap_mb=2.
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10))


MODELS = {"lesson": (_lesson_model, 2), "mlp": (_big_mlp, 256)}


def _batch(step, rank, n_in, n_out):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
    return torch.randn(8, n_in, generator=g), torch.randint(0, n_out, (8,), generator=g)


def _train(model_name, wrap, rank, steps, accumulate=1):
    """Train a wrapped model a few steps; return every step's synced gradients."""
    make, n_in = MODELS[model_name]
    torch.manual_seed(rank)  # different first weights per rank: the wrapper must broadcast
    model = wrap(make())
    n_out = list(model.module.parameters())[-1].shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = _batch(step * accumulate + micro, rank, n_in, n_out)
            last = micro == accumulate - 1
            # The last micro-batch syncs; the others only accumulate.
            with (contextlib.nullcontext() if last else model.no_sync()):
                F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.module.parameters()])
        opt.step()
    return grads


def _stock_vs_manual(rank, world_size, configs, steps, accumulate):
    """For each (model, bucket_cap_mb): stock's gradients, then BucketedDDP's and ManualDDP's."""
    results = {}
    for model_name, cap in configs:
        results[model_name, cap] = [
            _train(model_name, lambda m: wrapper(m, bucket_cap_mb=cap), rank, steps, accumulate)
            for wrapper in (DDP, BucketedDDP, ManualDDP)]
    return results


def _assert_bitwise(results):
    for rank, (stock, *mine) in enumerate(results):
        for name, manual in zip(("BucketedDDP", "ManualDDP"), mine):
            for step, (s_grads, m_grads) in enumerate(zip(stock, manual)):
                for i, (s, m) in enumerate(zip(s_grads, m_grads)):
                    assert torch.equal(s, m), f"rank {rank} step {step} param {i}: {name} != stock"
    first_rank = results[0][1:]
    for _, *mine in results[1:]:  # and every rank holds the same average
        for manual, first in zip(mine, first_rank):
            for a, b in zip(manual, first):
                assert all(torch.equal(x, y) for x, y in zip(a, b))


def _assert_all_bitwise(per_rank, configs):
    for config in configs:
        _assert_bitwise([results[config] for results in per_rank])


CONFIGS = [("lesson", None), ("mlp", None), ("mlp", 2)]
NO_SYNC_CONFIGS = [("lesson", None), ("mlp", None)]
share_spawn(_stock_vs_manual, [1, 2, 3, 4], CONFIGS, 3, 1, key="steps")
share_spawn(_stock_vs_manual, [2], NO_SYNC_CONFIGS, 3, 3, key="no_sync")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bucketed_bitwise_equal_to_stock(world_size):
    # The lesson's model (one bucket), and a 3.4M-parameter MLP at stock's default caps
    # (2 buckets) and at bucket_cap_mb=2 (4 buckets). Three steps: the first with one
    # bucket, the next two with the rebuilt ones.
    _assert_all_bitwise(shared_results(_stock_vs_manual, world_size, "steps"), CONFIGS)


def test_no_sync_bitwise_equal_to_stock():
    # Three micro-batches per step, the first two under no_sync().
    _assert_all_bitwise(shared_results(_stock_vs_manual, 2, "no_sync"), NO_SYNC_CONFIGS)


def _stock_buckets(rank, world_size, bucket_cap_mb):
    """What stock's reducer really packs: a comm hook sees each bucket's parameters."""
    model = _big_mlp()
    names = {p: n for n, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    seen = []

    def spy(state, bucket):
        seen.append((bucket.index(), [names[p] for p in bucket.parameters()],
                     bucket.buffer().numel()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, spy)
    for step in range(2):
        x, y = _batch(step, rank, 256, 10)
        F.cross_entropy(ddp(x), y).backward()
    layouts = {}
    for wrapper in (BucketedDDP, ManualDDP):
        manual = wrapper(_big_mlp(), bucket_cap_mb=bucket_cap_mb)
        layouts[wrapper.__name__] = []
        for step in range(2):
            x, y = _batch(step, rank, 256, 10)
            F.cross_entropy(manual(x), y).backward()
            layouts[wrapper.__name__].append(
                [(i, [manual._names[j] for j in b.indices], b.flat.numel())
                 for i, b in enumerate(manual.buckets)])
    return seen, layouts


@pytest.mark.parametrize("bucket_cap_mb,n_buckets", [(None, 2), (2, 4)])
def test_bucket_layout_is_stocks(bucket_cap_mb, n_buckets):
    (seen, layouts), = run_ranks(_stock_buckets, 1, bucket_cap_mb)
    assert layouts["BucketedDDP"] == layouts["ManualDDP"]
    first, rebuilt = layouts["ManualDDP"]
    assert len(first) == 1, "the first iteration uses one bucket"
    assert len(rebuilt) == n_buckets
    # The hook runs once per bucket per backward, in bucket order.
    assert seen == first + rebuilt
    assert rebuilt[0][1][0] == "8.bias", "the last layer's gradient arrives first"


def test_assign_buckets_rules():
    params = [torch.empty(n) for n in (200_000, 10, 200_000, 200_000)]  # 0.8 MB, 40 B, ...
    limits = bucket_size_limits()
    assert limits == [1 * MB, 25 * MB]
    assert assign_buckets(params, [float("inf")]) == [[0, 1, 2, 3]]
    # A bucket closes on reaching its limit, the filling parameter included; then 25 MB.
    assert assign_buckets(params, limits, order=[3, 2, 1, 0]) == [[3, 2], [1, 0]]
    assert assign_buckets(params, [1_200_000], order=[3, 2, 1, 0]) == [[3, 2], [1, 0]]
    assert bucket_size_limits(2) == [2 * MB]  # an explicit cap: no small first bucket
