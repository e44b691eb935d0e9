"""ShardedOptimizer (ZeRO-1 by hand) against a plain optimizer and PyTorch's ZeroRedundancyOptimizer.

    pytest tests/test_zero.py

ManualDDP averages the gradients in all three runs; then the full optimizer (every rank
updates everything), ZeroRedundancyOptimizer and ShardedOptimizer update the weights.
foreach=False on every side (the for-loop kernels; on CPU that is the default anyway).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from helpers import cli, run_ranks, share_spawn, shared_results
from minddp import ManualDDP, UsageError
from minddp.zero.optimizer import ShardedOptimizer


class TiedFrozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6).requires_grad_(False)
        self.mid = torch.nn.Linear(6, 24)
        self.out = torch.nn.Linear(24, 6)
        self.head = torch.nn.Linear(6, 6)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.head(self.out(torch.tanh(self.mid(torch.tanh(self.frozen(self.embed(x)))))))


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}),
              "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False})}


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def _three_ways(rank, world_size, name, steps=4):
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    base = TiedFrozen()
    models = [ManualDDP(copy.deepcopy(base)) for _ in range(3)]
    optimizers = [cls(models[0].parameters(), **kwargs),
                  ZeroRedundancyOptimizer(models[1].parameters(), cls, **kwargs),
                  ShardedOptimizer(models[2].parameters(), cls, **kwargs)]
    equal = []
    for step in range(steps):
        x, y = _batch(step, rank)
        for model, opt in zip(models, optimizers):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        weights = [[p.detach().clone() for p in m.module.parameters()] for m in models]
        equal.append([all(torch.equal(a, b) for a, b in zip(weights[0], w)) for w in weights[1:]])
    # The same shards as ZeroRedundancyOptimizer: which parameter lives on which rank.
    ids = {p: i for i, p in enumerate(models[1].parameters())}
    ids_sharded = {p: i for i, p in enumerate(models[2].parameters())}
    zero_shards = [[ids[p] for g in groups for p in g["params"]]
                   for groups in optimizers[1]._partition_parameters()]
    our_shards = [[ids_sharded[p] for g in groups for p in g["params"]]
                  for groups in optimizers[2]._shards()]
    local_state = len(optimizers[2].optim.state)
    return equal, zero_shards == our_shards, local_state, len(optimizers[0].state)


def _both_optimizers(rank, world_size):
    return {name: _three_ways(rank, world_size, name) for name in OPTIMIZERS}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bitwise_equal_to_plain_and_to_zero_redundancy_optimizer(world_size):
    by_rank = shared_results(_both_optimizers, world_size)
    for name in OPTIMIZERS:  # AdamW, and SGD with momentum
        results = [r[name] for r in by_rank]
        for equal, same_shards, _, _ in results:
            assert equal == [[True, True]] * 4, name  # ZeroRedundancyOptimizer, ShardedOptimizer
            assert same_shards, name
        # Optimizer state exists once across the ranks: the shards' states add up to the full one.
        assert sum(r[2] for r in results) == results[0][3] == 7, name  # 7 trainable tensors


def _resume(rank, world_size, tmp):
    cls, kwargs = OPTIMIZERS["adamw"]
    torch.manual_seed(0)
    base = TiedFrozen()
    whole, resumed = ManualDDP(copy.deepcopy(base)), ManualDDP(copy.deepcopy(base))
    opt = ShardedOptimizer(whole.parameters(), cls, **kwargs)
    messages = []
    try:
        opt.state_dict()
    except UsageError as err:
        messages.append(str(err))
    for step in range(4):
        if step == 2:  # save half way: the weights, and the optimizer state consolidated
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save({"model": whole.module.state_dict(), "optim": opt.state_dict()},
                           f"{tmp}/ck.pt")
            torch.distributed.barrier()
            saved = torch.load(f"{tmp}/ck.pt", weights_only=True)
            plain = cls(copy.deepcopy(base).parameters(), **kwargs)
            plain.load_state_dict(saved["optim"])  # a plain optimizer loads it too
            resumed.module.load_state_dict(saved["model"])
            opt2 = ShardedOptimizer(resumed.parameters(), cls, **kwargs)
            opt2.load_state_dict(saved["optim"])
        x, y = _batch(step, rank)
        for model, o in ((whole, opt), (resumed, opt2)) if step >= 2 else ((whole, opt),):
            o.zero_grad()
            F.mse_loss(model(x), y).backward()
            o.step()
    same = all(torch.equal(a, b) for a, b in zip(whole.module.parameters(), resumed.module.parameters()))
    # A parameter that joins the groups behind the optimizer's back: a clear error.
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.ones(3)))
    try:
        opt.step()
    except UsageError as err:
        messages.append(str(err))
    return same, messages


def test_consolidate_and_resume_bit_for_bit(tmp_path):
    for same, messages in run_ranks(_resume, 2, str(tmp_path)):
        assert same
        assert messages[0].startswith("rank ") and "consolidate_state_dict(to=RANK)" in messages[0]
        assert messages[1].startswith("parameter #9 of the optimizer's groups is in no shard")


def _different_params(rank, world_size):
    try:
        ShardedOptimizer(torch.nn.Linear(3, 3 + rank).parameters(), torch.optim.SGD, lr=0.1)
    except UsageError as err:
        return str(err)


def test_different_parameter_lists_are_a_clear_error():
    for message in shared_results(_different_params, 2):
        assert message.startswith("rank 1's optimizer parameters differ from rank 0's")


def test_zero_bench_reports_state_per_rank():
    result = cli("zero-bench", "--sizes", "0.3M", "--world-sizes", "2",
                 "--rounds", "2", "--warmup", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {" ".join(line.split()[2:-5]): line.split() for line in result.stdout.splitlines()
            if line.startswith("2 ")}
    assert list(rows) == ["full AdamW", "ShardedOptimizer", "ZeroRedundancyOptimizer"]
    # 0.27M float32 parameters, AdamW: 2.0 MB of state on every rank, 1.0 MB with ZeRO-1.
    assert rows["full AdamW"][-5] == "2.0" and rows["full AdamW"][-3] == "4.1"
    assert rows["ShardedOptimizer"][-5] == rows["ZeroRedundancyOptimizer"][-5] == "1.0"
    assert rows["ShardedOptimizer"][-3] == "2.0"


share_spawn(_both_optimizers, [1, 2, 3, 4])  # one spawn per world size, shared
share_spawn(_different_params, [2])
