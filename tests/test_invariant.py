"""The invariant mode (minddp/invariant/): one program, the same bits on any mesh as in one process.

    pytest tests/test_invariant.py

The small GPT of examples/gpt_nd.py trains 5 AdamW steps in invariant mode on every mesh of
dp in {1, 2, 4} x tp in {1, 2} x pp in {1, 2} up to 4 ranks (the shared spawns of 1, 2 and
4 ranks) and of 8 ranks (the 8-rank spawn), each with fully_shard and with DDP along dp,
sequence parallel, --clip, dropout and recomputation on in turn. Every step's loss, every whole gradient, and
after the last step every whole weight and AdamW state must be torch.equal to the run in
one process. Unit checks of the tree, the chunks and the refusals run in this process.
"""

import copy
import itertools
import os

import pytest
import torch
import torch.distributed as dist

from helpers import share_spawn, shared_results, usage_errors
from minddp.bench.transformer import gpt
from minddp.invariant.tree import Folder, fold, tree_sum
from minddp.mesh.device_mesh import init_device_mesh
from minddp.references.libraries import LIBRARIES

SIZES = dict(vocab=32, d=16, heads=4, tokens=8)
STEPS = 5
# (dp, tp, pp) of each world size, the mesh names outermost first
SHAPES = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
          4: [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)],
          8: [(4, 2, 1), (4, 1, 2), (2, 2, 2)]}
# name: (dp, tied, clip, dropout, sequence parallel, recompute)
CONFIGS = {"fsdp": ("fsdp", False, 0.1, 0.1, True, "none"),
           "ddp, selective recompute": ("ddp", False, 0.1, 0.1, True, "selective"),
           "tied, plain tp, full recompute": ("fsdp", True, None, 0.1, False, "full")}


def _mesh(shape):
    dims = [(n, s) for n, s in zip(("pp", "dp", "tp"), (shape[2], shape[0], shape[1]))
            if s > 1] or [("dp", 1)]
    return init_device_mesh("cpu", tuple(s for _, s in dims),
                            mesh_dim_names=tuple(n for n, _ in dims))


def _whole(tensor, name, cuts):
    """A weight, gradient or optimizer state, whole: gathered over dp (a fully_shard shard)
    and over tp (a slice). Collective."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    if name in cuts:
        dim, group = cuts[name]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        tensor = torch.cat(parts, dim)
    return tensor.detach().clone()


def _train(shape, config):
    """5 steps on this mesh: (losses, [{name: whole gradient}], {name: (weight, exp_avg,
    exp_avg_sq)}) for the weights this rank's stage holds."""
    from minddp.invariant.step import InvariantTraining
    from minddp.tp.plan import sliced
    from minddp.memory.recompute import POLICIES
    dp, tied, clip, dropout, sp, recompute = CONFIGS[config]
    if tied and shape[2] > 1:
        return None  # a tied embedding does not split over stages (gpt_nd.py refuses it)
    torch.manual_seed(0)
    model = gpt(**SIZES, blocks=2, tied=tied)
    training = InvariantTraining(model, _mesh(shape), dp=dp, shards=8, chunks=4, batch=8,
                                 fully_shard=LIBRARIES["manual"].fully_shard, seed=0,
                                 sequence_parallel=sp, dropout=dropout,
                                 recompute=POLICIES[recompute])
    named = dict(training.stage.named_parameters())
    optimizer = torch.optim.AdamW(named.values(), lr=1e-2, foreach=False)
    cuts = sliced(model)
    losses, grads = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, SIZES["vocab"], (8, SIZES["tokens"] + 1), generator=g)
        optimizer.zero_grad()
        loss, whole = training.step(step, tokens[:, :-1].contiguous(),
                                    tokens[:, 1:].contiguous())
        losses.append(loss)
        grads.append({n: _whole(p.grad, n, cuts) for n, p in named.items()})
        if clip is not None:
            training.clip_grad_norm_(whole, clip)
        optimizer.step()
    state = {n: tuple(_whole(t, n, cuts) for t in (p, optimizer.state[p]["exp_avg"],
                                                   optimizer.state[p]["exp_avg_sq"]))
             for n, p in named.items()}
    return losses, grads, state


def _invariant(rank, world_size):
    return {(shape, config): _train(shape, config)
            for shape in SHAPES[world_size] for config in CONFIGS}


share_spawn(_invariant, [1, 2, 4, 8])


def _differences(run, reference):
    """What in `run` (one rank's) is not torch.equal to the one-process `reference`."""
    (losses, grads, state), (losses_1, grads_1, state_1) = run, reference
    found = [f"step {s} loss" for s, (a, b) in enumerate(zip(losses, losses_1))
             if a is not None and not torch.equal(a, b)]
    for step, (g, g_1) in enumerate(zip(grads, grads_1)):
        found += [f"step {step} grad {n}" for n in g if not torch.equal(g[n], g_1[n])]
    found += [f"{what} {n}" for n in state for what, a, b in
              zip(("weight", "exp_avg", "exp_avg_sq"), state[n], state_1[n])
              if not torch.equal(a, b)]
    return found


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", [s for w in (2, 4, 8) for s in SHAPES[w]],
                         ids=lambda s: "dp{}-tp{}-pp{}".format(*s))
def test_every_mesh_gives_one_process_bits(shape, config):
    reference = shared_results(_invariant, 1)[0][(1, 1, 1), config]
    runs = shared_results(_invariant, shape[0] * shape[1] * shape[2])
    for rank, results in enumerate(runs):
        run = results[shape, config]
        if run is None:
            continue  # tied weights over pipeline stages: refused
        assert not _differences(run, reference), (rank, _differences(run, reference)[:5])
        held = set(run[2])  # every rank compared something: its stage's weights
        assert held and held <= set(reference[2]), rank
        assert any(loss is not None for loss in run[0]) or shape[2] > 1
