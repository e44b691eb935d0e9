"""Mixture of experts (minddp/ep/experts.py) and expert parallelism (minddp/ep/parallel.py) against one process.

    pytest tests/test_experts.py

The layer in one process against its definition (every expert on every token, masked by
the router's choice, float64) and Switch's balancing loss against its formula; capacity
keeps each expert's first tokens. Then expert parallelism at 2 and 4 ranks (ep=W, and
dp=2 x ep=2), top-1 and top-2, dropless and with a capacity, every rank its own number of
tokens: 3 AdamW steps, each rank's output, the router's and every expert's gradient and
every weight after `torch.equal` to one process on the whole batch
(minddp/references/moe.py: each expert run once per ep group on the rows in the order
(rank, token) the all_to_all delivers them; the replicated weights' rank parts added in
rank order). The small GPT with MoE MLPs likewise. At 2 ranks the gradients are averaged by
ep.sync_gradients itself (a + b = b + a); at 4 the replicated ones in rank order on both
sides (gloo adds 4 ranks' tensors in an order of its own).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import share_spawn, shared_results, usage_errors
from minddp.ep.experts import MoE, sort_by_expert
from minddp.references.moe import (OneProcessMoEGPT, balance_by_definition, dense_moe,
                                        one_process_moe, rank_order_sum)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_layer_is_its_definition(top_k):
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=top_k)
    x = torch.randn(30, 8)
    assert torch.allclose(moe(x).double(), dense_moe(moe, x), atol=1e-6, rtol=0)
    assert int(moe.tokens_per_expert.sum()) == 30 * top_k  # dropless: every pair


def test_capacity_keeps_each_experts_first_tokens_and_drops_the_rest():
    chosen = torch.tensor([[2], [0], [2], [2], [1], [2], [0]])  # top-1, 7 tokens
    kept, counts = sort_by_expert(chosen, 4, capacity=2)
    assert counts.tolist() == [2, 1, 2, 0]
    assert kept.tolist() == [1, 6, 4, 0, 2]  # expert 2's third and fourth tokens dropped
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=1, capacity_factor=1.0)  # ceil(12 / 4) = 3 per expert
    x = torch.randn(12, 8)
    y = moe(x)
    chosen = moe.router(x).softmax(-1).argmax(-1)
    dropped = [t for t in range(12) if (chosen[:t] == chosen[t]).sum() >= 3]
    assert dropped, chosen  # this seed sends more than 3 tokens to an expert
    assert all(y[t].abs().max() == 0 for t in dropped)  # nothing added: the residual carries it
    assert int(moe.tokens_per_expert.sum()) == 12 - len(dropped)


def test_the_balancing_loss_is_switchs():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2)
    x = torch.randn(30, 8)
    moe(x)
    assert torch.allclose(moe.balance_loss, balance_by_definition(moe, x), atol=1e-6)
    torch.nn.init.zeros_(moe.router.weight)  # every probability 1/E: the loss's minimum
    moe(x)
    assert moe.balance_loss.item() == pytest.approx(1.0)


def _tokens(rank, step):
    """Rank r's own tokens at a step: 6 + 2r of them (uneven splits), its own seed."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6 + 2 * rank, 8, generator=g), torch.randn(6 + 2 * rank, 8, generator=g)


def _mesh(world_size, dp):
    from minddp.mesh.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "ep"))


def _sync(model, mesh, world_size):
    """ep.sync_gradients at 2 ranks; at 4, the replicated weights in rank order."""
    from minddp.ep import parallel as ep
    if world_size == 2:
        return ep.sync_gradients(model, mesh)
    experts = {id(p) for m in model.modules() if isinstance(m, ep.ExpertsOnRanks)
               for p in m.parameters()}
    for p in model.parameters():
        if id(p) in experts:
            if mesh.size("dp") > 1:
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
        else:
            parts = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(parts, p.grad)
            p.grad = rank_order_sum(parts)
        p.grad /= world_size


def _layer(rank, world_size, dp, top_k, capacity):
    """3 AdamW steps of one MoE layer under expert parallelism, and of one process."""
    from minddp.ep.parallel import expert_parallel
    torch.manual_seed(0)
    layer = MoE(8, 16, 8, top_k=top_k, capacity_factor=capacity)
    master = copy.deepcopy(layer)
    mesh = _mesh(world_size, dp)
    expert_parallel(layer, mesh)
    ep = world_size // dp
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
                  for m in (layer, master)]
    differ = []
    for step in range(3):
        x, target = _tokens(rank, step)
        y = layer(x)
        (F.mse_loss(y, target) + 0.01 * layer.balance_loss).backward()
        _sync(layer, mesh, world_size)
        # one process: every rank's tokens, a router per rank, the experts once per group
        data = [_tokens(r, step) for r in range(world_size)]
        routers = [copy.deepcopy(master.router) for _ in range(world_size)]
        experts = [copy.deepcopy(master.experts) for _ in range(dp)]
        outs, balances, _ = one_process_moe(routers, experts, master, [d[0] for d in data], ep)
        torch.autograd.backward([F.mse_loss(o, d[1]) + 0.01 * b
                                 for o, d, b in zip(outs, data, balances)])
        master.router.weight.grad = rank_order_sum([r.weight.grad for r in routers]) / world_size
        for name, p in master.experts.named_parameters():
            p.grad = rank_order_sum([dict(e.named_parameters())[name].grad
                                     for e in experts]) / world_size
        if not torch.equal(y, outs[rank]):
            differ.append(f"step {step} output")
        differ += _differ(layer, master, f"step {step} gradient", lambda p: p.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return differ + _differ(layer, master, "weight", lambda p: p.detach())


def _differ(ours, theirs, what, get):
    """The names of `ours`' parameters (this rank's experts, the router) whose `get` differs."""
    theirs = dict(theirs.named_parameters())
    return [f"{what} {name}" for name, p in ours.named_parameters()
            if not torch.equal(get(p), get(theirs[name]))]


LAYER_CASES = {2: [(1, 1, None), (1, 2, None), (1, 1, 1.0), (1, 2, 1.25)],
               4: [(1, 1, None), (1, 2, 1.25), (2, 2, None), (2, 1, 1.0)]}
for _size, _cases in LAYER_CASES.items():
    for _case in _cases:
        share_spawn(_layer, [_size], *_case, key="-".join(map(str, _case)))


def _case_id(case):
    dp, top_k, capacity = case
    return f"dp{dp}-top{top_k}-" + ("dropless" if capacity is None else f"capacity{capacity}")


@pytest.mark.parametrize("world_size,case", [(w, c) for w, cs in LAYER_CASES.items()
                                             for c in cs],
                         ids=lambda x: _case_id(x) if isinstance(x, tuple) else str(x))
def test_expert_parallel_layer_is_one_process_on_the_whole_batch(world_size, case):
    for rank, differ in enumerate(shared_results(_layer, world_size,
                                                 key="-".join(map(str, case)))):
        assert differ == [], (rank, differ[:5])


def _gpt(rank, world_size, dp, top_k, capacity):
    """The MoE GPT, 3 AdamW steps, expert-parallel and one process: what differs."""
    from minddp.bench.transformer import moe_gpt
    from minddp.ep.parallel import expert_parallel
    torch.manual_seed(0)
    model = moe_gpt(experts=4, top_k=top_k, capacity_factor=capacity)
    master = copy.deepcopy(model)
    mesh = _mesh(world_size, dp)
    expert_parallel(model, mesh)
    one = OneProcessMoEGPT(master, world_size, world_size // dp)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
                  for m in (model, master)]
    differ = []
    for step in range(3):
        data = []
        for r in range(world_size):  # every rank its own sequences
            g = torch.Generator().manual_seed(10 * step + r)
            tokens = torch.randint(0, 32, (2, 9), generator=g)
            data.append((tokens[:, :-1], tokens[:, 1:]))
        x, y = data[rank]
        logits = model(x)
        balance = sum(block.mlp.balance_loss for block in list(model)[1:-1])
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.01 * balance
        loss.backward()
        _sync(model, mesh, world_size)
        losses = one.losses([d[0] for d in data], [d[1] for d in data], 0.01)
        torch.autograd.backward(losses)
        for name, grad in one.gradients().items():
            dict(master.named_parameters())[name].grad = grad
        if loss.item() != losses[rank].item():
            differ.append(f"step {step} loss")
        differ += _differ(model, master, f"step {step} gradient", lambda p: p.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return differ + _differ(model, master, "weight", lambda p: p.detach())


GPT_CASES = {2: [(1, 2, None)], 4: [(1, 1, None), (2, 2, 1.25)]}
for _size, _cases in GPT_CASES.items():
    for _case in _cases:
        share_spawn(_gpt, [_size], *_case, key="-".join(map(str, _case)))


@pytest.mark.parametrize("world_size,case", [(w, c) for w, cs in GPT_CASES.items() for c in cs],
                         ids=lambda x: _case_id(x) if isinstance(x, tuple) else str(x))
def test_the_moe_gpt_under_expert_parallelism_is_the_one_process_model(world_size, case):
    for rank, differ in enumerate(shared_results(_gpt, world_size,
                                                 key="-".join(map(str, case)))):
        assert differ == [], (rank, differ[:5])


def _refusals(rank, world_size):
    from minddp.ep.parallel import ExpertsOnRanks
    from minddp.ep.experts import Experts
    return usage_errors([
        ("split", lambda: ExpertsOnRanks(Experts(8, 16, 3))),
        ("top_k", lambda: MoE(8, 16, 4, top_k=5)),
        ("capacity", lambda: MoE(8, 16, 4, capacity_factor=0)),
    ])


share_spawn(_refusals, [2])


def test_bad_input_is_one_line():
    for said in shared_results(_refusals, 2):
        assert said["split"].startswith("3 experts do not split over 2 ranks")
        assert said["top_k"].startswith("top_k=5 with 4 experts: a token goes to 1 to 4 of")
        assert said["capacity"].startswith("capacity_factor=0: no expert could take a token")
