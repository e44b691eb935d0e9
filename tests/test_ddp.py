"""ManualDDP against the trusted references: stock DDP, and one process on the full batch.

NaiveDDP (one all_reduce per parameter) is checked here; test_buckets.py checks
the bucketed default against stock bit for bit.

    pytest tests/test_ddp.py
"""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import run, share_spawn, shared_results
from minddp import ManualDDP, NaiveDDP, NeuralNetwork
from minddp.tools.tables import write_table


def _mlp():
    # The lesson's model plus a wider one, so several layers of real size are averaged.
    return torch.nn.Sequential(NeuralNetwork(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _stock_vs_manual(rank, world_size, steps):
    torch.manual_seed(rank)  # different weights per rank: both wrappers must broadcast rank 0's
    base = _mlp()
    stock, manual = DDP(copy.deepcopy(base)), NaiveDDP(copy.deepcopy(base))
    opt_s = torch.optim.SGD(stock.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(manual.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
        x, y = torch.randn(4, 2, generator=g), torch.randint(0, 3, (4,), generator=g)
        grads = {}
        for name, model, opt in (("stock", stock, opt_s), ("manual", manual, opt_m)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads[name] = [p.grad.clone() for p in model.module.parameters()]
            opt.step()
        record.append(grads)
    return record


@pytest.mark.parametrize("world_size", [1, 2])
def test_naive_bitwise_equal_to_stock_ddp(world_size):
    results = shared_results(_stock_vs_manual, world_size)
    for rank_record in results:
        for step, grads in enumerate(rank_record):
            for s, m in zip(grads["stock"], grads["manual"]):
                assert torch.equal(s, m), f"step {step}: manual differs from stock"
    for rank_record in results[1:]:  # and every rank holds the same average
        for a, b in zip(rank_record, results[0]):
            assert all(torch.equal(x, y) for x, y in zip(a["manual"], b["manual"]))


def test_naive_close_to_stock_ddp_at_three_ranks(tmp_path):
    # Three addends: the all_reduce of one flat bucket (stock) and of each parameter
    # (naive) may add them in another order, so the last bits may differ.
    results = shared_results(_stock_vs_manual, 3)
    worst = max((s - m).abs().max().item()
                for rank_record in results for grads in rank_record
                for s, m in zip(grads["stock"], grads["manual"]))
    # Not equal, and not far: gloo's ring at 3 ranks adds a flat bucket's elements in another
    # order than single parameters (deterministic: the same data and sizes every run).
    assert 0 < worst <= 1e-6
    # And the diff tool, given both as gradient tables, says why they differ.
    names = [n for n, _ in _mlp().named_parameters()]
    for who in ("stock", "manual"):
        write_table(str(tmp_path / who), [
            [(step, 0, {n: g.numpy() for n, g in zip(names, grads[who])})
             for step, grads in enumerate(rank_record)] for rank_record in results])
    verdict = run([sys.executable, "-m", "minddp", "diff", str(tmp_path / "manual"),
                   str(tmp_path / "stock")])
    assert verdict.returncode == 1, verdict.stdout
    assert "different summation order" in verdict.stdout, verdict.stdout
    assert "NaiveDDP" in verdict.stdout


class TiedFrozen(torch.nn.Module):
    """A model with the two cases a naive hook gets wrong: a tied weight and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 6)
        self.head.weight = self.embed.weight  # tied: one Parameter, used twice

    def forward(self, x):
        return self.head(torch.tanh(self.frozen(torch.tanh(self.embed(x)))))


def _full_batch_reference(rank, world_size, steps, bucketed):
    torch.manual_seed(0)
    single = TiedFrozen().double()
    ddp = (ManualDDP if bucketed else NaiveDDP)(copy.deepcopy(single))
    opt_single = torch.optim.SGD(single.parameters(), lr=0.2)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.2)
    frozen_before = ddp.module.frozen.weight.clone()
    gaps = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        y = torch.randn(8, 6, generator=g, dtype=torch.float64)
        # One process, the whole batch: the reference.
        opt_single.zero_grad()
        F.mse_loss(single(x), y).backward()
        opt_single.step()
        # This rank's equal share of the batch; the mean of the shards' mean losses is the
        # full batch's mean loss, so the averaged gradient must be the full-batch gradient.
        shard = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        opt_ddp.zero_grad()
        F.mse_loss(ddp(x[shard]), y[shard]).backward()
        opt_ddp.step()
        gaps.append(max((a - b).abs().max().item()
                        for a, b in zip(single.parameters(), ddp.module.parameters())))
    assert ddp.module.frozen.weight.grad is None
    assert torch.equal(ddp.module.frozen.weight, frozen_before)
    assert ddp.module.head.weight is ddp.module.embed.weight
    return gaps


@pytest.mark.parametrize("world_size,bucketed", [(2, True), (4, False)])
def test_equals_one_process_on_the_full_batch(world_size, bucketed):
    results = shared_results(_full_batch_reference, world_size, str(bucketed))
    for gaps in results:
        assert max(gaps) < 1e-12, gaps  # float64: only summation order separates them


share_spawn(_stock_vs_manual, [1, 2, 3], 4)  # one spawn per world size, shared
share_spawn(_full_batch_reference, [2], 5, True, key="True")
share_spawn(_full_batch_reference, [4], 5, False, key="False")
