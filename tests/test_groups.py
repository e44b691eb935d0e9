"""Every lesson that takes a process group, on a group that leaves out global rank 0.

    pytest tests/test_groups.py

4 spawned ranks; `new_group([2, 3])` and `new_group([1, 3])` hold the work, the other ranks
only make the groups (every rank must). Each rank starts from weights of its own seed, so a
broadcast from the wrong rank shows, and feeds its own batch. On the group's ranks, stock and
minddp must agree bit for bit at every step: gradients and weights.
"""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import share_spawn, shared_results
from minddp import BucketedDDP, ManualDDP, NaiveDDP, NeuralNetwork
from minddp.groups import global_rank, is_member, members

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


def _on_subgroups(rank, world_size):
    out = {}
    for key, ranks in GROUPS.items():
        group = dist.new_group(ranks)  # collective over the world: every rank makes it
        facts = {"member": is_member(group)}
        if is_member(group):
            facts.update(members=members(group), first=global_rank(group, 0),
                         cases={w: _ddp_case(rank, group, w) for w in WRAPPERS})
        out[key] = facts
        gc.collect()  # the wrappers (hooks make cycles) let go of the group before it goes
        dist.barrier()
        dist.destroy_process_group(group)
    return out


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
