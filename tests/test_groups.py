"""Every lesson that takes a process group, on a group that leaves out global rank 0.

    pytest tests/test_groups.py

4 spawned ranks; `new_group([2, 3])` and `new_group([1, 3])` hold the work, the other ranks
only make the groups (every rank must). Each rank starts from weights of its own seed, so a
broadcast from the wrong rank shows, and feeds its own batch. On the group's ranks, stock and
minddp must agree bit for bit at every step: gradients and weights. Everything is imported
at the top, before any group exists: torch.distributed.optim imported after new_group()
keeps that group alive past its destroy (torch 2.13), and the spawn's teardown check fails.
"""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import parallel as stock_tp
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import share_spawn, shared_results
from minddp import BucketedDDP, ManualDDP, NaiveDDP, NeuralNetwork, ShardedOptimizer, fully_shard
from minddp import pp, tp
from minddp.launch.groups import global_rank, is_member, members
from minddp.launch.teardown import forget_dtensor_caches

GROUPS = {"2,3": [2, 3], "1,3": [1, 3]}
WRAPPERS = {"NaiveDDP": NaiveDDP, "BucketedDDP": BucketedDDP, "ManualDDP": ManualDDP}


def _model():
    return torch.nn.Sequential(NeuralNetwork(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _ddp_case(rank, group, wrapper, steps=3):
    torch.manual_seed(10 + rank)  # another model on every rank: only a broadcast agrees them
    base = _model()
    stock = DDP(copy.deepcopy(base), process_group=group)
    mine = WRAPPERS[wrapper](copy.deepcopy(base), process_group=group)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, mine)]
    differ = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(4, 2, generator=g), torch.randint(0, 3, (4,), generator=g)
        seen = []
        for model, opt in zip((stock, mine), opts):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads = [p.grad.clone() for p in model.module.parameters()]
            opt.step()
            seen.append((grads, [p.detach().clone() for p in model.module.parameters()]))
        (g_s, w_s), (g_m, w_m) = seen
        names = [n for n, _ in base.named_parameters()]
        differ += [f"step {step} grad {n}" for n, a, b in zip(names, g_s, g_m) if not torch.equal(a, b)]
        differ += [f"step {step} weight {n}" for n, a, b in zip(names, w_s, w_m)
                   if not torch.equal(a, b)]
    return differ


def _steps(models, optimizers, rank, steps=3, batch=lambda step, rank: _batch(step, rank),
           loss=lambda out, y: F.cross_entropy(out, y)):
    """Train stock's and minddp's side by side; the names of what differs, per step."""
    differ = []
    for step in range(steps):
        x, y = batch(step, rank)
        seen = []
        for model, opt in zip(models, optimizers):
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
            seen.append({n: _local(p).detach().clone() for n, p in model.named_parameters()})
        differ += [f"step {step} weight {n}" for n in seen[0]
                   if not torch.equal(seen[0][n], seen[1][n])]
    return differ


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
    return torch.randn(4, 2, generator=g), torch.randint(0, 3, (4,), generator=g)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _zero_case(rank, group):
    torch.manual_seed(0)
    models = [_model(), _model()]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.AdamW,
                                          process_group=group, lr=0.01),
                  ShardedOptimizer(models[1].parameters(), torch.optim.AdamW,
                                   process_group=group, lr=0.01)]
    return _steps(models, optimizers, rank)


def _fsdp_case(rank, group):
    torch.manual_seed(10 + rank)  # every rank its own weights, to start
    base = _model()
    mesh = DeviceMesh.from_group(group, "cpu")
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    # Stock's fully_shard does not broadcast (it assumes equal weights): both start from group
    # rank 0's, so the comparison is of the sharded training, not of the first copy.
    for m in models:
        for p in m.parameters():
            dist.broadcast(p.data, src=global_rank(group, 0), group=group)
    for unit in (models[0][0], models[0]):
        stock_fully_shard(unit, mesh=mesh)
    for unit in (models[1][0], models[1]):
        fully_shard(unit, mesh=mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    return _steps(models, optimizers, rank)


def _tp_case(rank, group):
    torch.manual_seed(10 + rank)
    base = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    mesh = DeviceMesh.from_group(group, "cpu")
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for lib, model in zip((stock_tp, tp), models):
        lib.parallelize_module(model, mesh, {"0": lib.ColwiseParallel(), "2": lib.RowwiseParallel()})
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    return _steps(models, optimizers, rank, batch=lambda step, rank: _batch(step, 0))


def _pp_case(rank, group):
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    stage, stages = dist.get_rank(group), dist.get_world_size(group)
    layers = [copy.deepcopy(pp.stage_layers(whole, stage, stages)) for _ in range(2)]
    runners = [ScheduleGPipe(PipelineStage(layers[0], stage, stages, torch.device("cpu"),
                                           group=group), 2, loss_fn=F.mse_loss),
               pp.ScheduleGPipe(pp.PipelineStage(layers[1], stage, stages, group=group), 2,
                                loss_fn=F.mse_loss)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in layers]
    differ = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
        for runner, opt in zip(runners, optimizers):
            opt.zero_grad()
            if stage == 0:
                runner.step(x)
            else:
                runner.step(target=y)
            opt.step()
        differ += [f"step {step} weight {i}" for i, (a, b) in
                   enumerate(zip(layers[0].parameters(), layers[1].parameters()))
                   if not torch.equal(a, b)]
    return differ


def _join_case(rank, group):
    torch.manual_seed(10 + rank)
    base = _model()
    states = []
    for wrapper in (DDP, ManualDDP):
        model = wrapper(copy.deepcopy(base), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with model.join():
            for step in range(2 + 2 * dist.get_rank(group)):  # uneven: group rank 1 goes on
                x, y = _batch(step, rank)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        states.append({k: v.clone() for k, v in model.module.state_dict().items()})
    return [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]


LESSONS = {"ZeRO-1": _zero_case, "FSDP": _fsdp_case, "TP": _tp_case, "PP": _pp_case,
           "join": _join_case}


def _on_subgroups(rank, world_size):
    out = {}
    for key, ranks in GROUPS.items():
        group = dist.new_group(ranks)  # collective over the world: every rank makes it
        facts = {"member": is_member(group)}
        if is_member(group):
            facts.update(members=members(group), first=global_rank(group, 0),
                         cases={w: _ddp_case(rank, group, w) for w in WRAPPERS})
            facts["lessons"] = {name: _guarded(case, rank, group) for name, case in LESSONS.items()}
        out[key] = facts
        gc.collect()  # what held the group goes before the group does (the wrappers, meshes)
        forget_dtensor_caches()
        dist.barrier()
        dist.destroy_process_group(group)
    return out


def _guarded(case, rank, group):
    """The case's result, or its error as text: one lesson failing does not fail the others."""
    try:
        return case(rank, group)
    except Exception as e:  # noqa: BLE001  (reported by the lesson's own test)
        return [f"raised {type(e).__name__}: {e}"]


share_spawn(_on_subgroups, [4])


@pytest.mark.parametrize("key", list(GROUPS))
def test_groups_name_their_members_and_global_ranks(key):
    for rank, out in enumerate(shared_results(_on_subgroups, 4)):
        facts = out[key]
        assert facts["member"] == (rank in GROUPS[key]), (rank, facts)
        if facts["member"]:
            assert facts["members"] == GROUPS[key] and facts["first"] == GROUPS[key][0]


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("key", list(GROUPS))
def test_ddp_on_a_group_without_rank_0_equals_stock(key, wrapper):
    for rank in GROUPS[key]:
        differ = shared_results(_on_subgroups, 4)[rank][key]["cases"][wrapper]
        assert differ == [], f"rank {rank}, group [{key}], {wrapper}: {differ[:4]}"


@pytest.mark.parametrize("lesson", list(LESSONS))
@pytest.mark.parametrize("key", list(GROUPS))
def test_every_lesson_on_a_group_without_rank_0_equals_stock(key, lesson):
    for rank in GROUPS[key]:
        differ = shared_results(_on_subgroups, 4)[rank][key]["lessons"][lesson]
        assert differ == [], f"rank {rank}, group [{key}], {lesson} vs stock: {differ[:4]}"
