"""The device mesh (minddp/mesh/device_mesh.py) against init_device_mesh, and compositions on it vs stock's.

    pytest tests/test_mesh.py

One spawn of 4 ranks (and one of 8) builds stock's mesh and minddp's for every shape of that
world size and compares, dimension by dimension, the ranks of this rank's group, its slice,
its coordinates and its place in each group, and the slices of several dimensions. On the
same spawn, compositions of lessons on meshes of 4 ranks train beside stock's same
composition from the same weights and batches: DDP (dp) x TP (tp), FSDP (dp) x TP with
sequence parallel (tp), PP (pp) x FSDP (dp), HSDP (dp_replicate, dp_shard) x TP with
sequence parallel (tp, 8 ranks too). After each of 3 AdamW steps the loss, every gradient
(this rank's part, as stock holds it) and every weight must be torch.equal on every rank.
"""

import contextlib
import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.distributed import pipelining as stock_pipelining
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import parallel as stock_tp
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import share_spawn, shared_results
import minddp.pp
import minddp.tp.sequence_parallel
import minddp.tp
import minddp
from minddp import ManualDDP, UsageError
from minddp.bench.transformer import Block
from minddp.launch.groups import members
from minddp.mesh.device_mesh import DeviceMesh, check_mesh, grid_groups, init_device_mesh

SHAPES = {4: [(4,), (2, 2), (1, 4), (4, 1)], 8: [(2, 2, 2), (2, 4), (8,)]}
NAMES = ("pp", "dp", "tp")


def _names(shape):
    return NAMES[-len(shape):]


def _groups(rank, world_size):
    problems = []
    for shape in SHAPES[world_size]:
        names = _names(shape)
        stock = stock_mesh("cpu", shape, mesh_dim_names=names)
        mine = init_device_mesh("cpu", shape, mesh_dim_names=names)
        case = f"{shape} {names}"
        if mine.get_coordinate() != list(stock.get_coordinate()):
            problems.append(f"{case}: coordinate {mine.get_coordinate()} vs {stock.get_coordinate()}")
        for name in names:
            want = dist.get_process_group_ranks(stock.get_group(name))
            got = members(mine.get_group(name))
            if got != want:
                problems.append(f"{case} {name}: group {got} vs stock's {want}")
            if mine[name].mesh.tolist() != stock[name].mesh.tolist():
                problems.append(f"{case} {name}: slice {mine[name].mesh.tolist()}")
            if mine.get_local_rank(name) != stock.get_local_rank(name):
                problems.append(f"{case} {name}: local rank {mine.get_local_rank(name)}")
            if mine.get_local_rank(name) != dist.get_rank(mine[name].get_group()):
                problems.append(f"{case} {name}: local rank is not the group rank")
            here = want.index(rank)
            expected = (want[here - 1] if here else None,
                        want[here + 1] if here + 1 < len(want) else None)
            if mine.neighbours(name) != expected:
                problems.append(f"{case} {name}: neighbours {mine.neighbours(name)}")
        # Slices of several dimensions, in the mesh's order (HSDP's ("dp_replicate", "dp_shard"))
        for k in range(2, len(names) + 1):
            for sub in itertools.combinations(names, k):
                theirs, ours = stock[sub], mine[sub]
                if (ours.mesh.tolist(), ours.mesh_dim_names, ours.get_coordinate()) != (
                        theirs.mesh.tolist(), theirs.mesh_dim_names, list(theirs.get_coordinate())):
                    problems.append(f"{case} {sub}: slice {ours}")
                for name in sub:
                    if members(ours.get_group(name)) != dist.get_process_group_ranks(
                            theirs.get_group(name)):
                        problems.append(f"{case} {sub}: its {name} group")
    return problems


TP_PLAN = {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row",
           "mlp.up": "col", "mlp.down": "row"}
# Sequence parallel: LayerNorms on each tp rank's tokens, gathered before the column splits.
SP_PLAN = {"ln1": "sp", "attn": "gather", "attn.q": "col", "attn.k": "col", "attn.v": "col",
           "attn.o": "row-sp", "ln2": "sp", "mlp": "gather", "mlp.up": "col", "mlp.down": "row-sp"}


def _plan(library, plan):
    tp = {"stock": stock_tp, "minddp": minddp.tp}[library]
    sp = {"stock": stock_tp, "minddp": minddp.tp.sequence_parallel}[library]
    styles = {"col": lambda: tp.ColwiseParallel(), "row": lambda: tp.RowwiseParallel(),
              "row-sp": lambda: tp.RowwiseParallel(output_layouts=Shard(1)),
              "sp": lambda: sp.SequenceParallel(),
              "gather": lambda: sp.PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),))}
    return {name: styles[style]() for name, style in plan.items()}


def _local(t):
    """This rank's part, as stock holds it (a Partial gradient made whole first)."""
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            t = t.redistribute(placements=[Replicate()] * len(t.placements))
        return t.to_local()
    return t


PARALLELIZE = {"stock": stock_tp.parallelize_module, "minddp": minddp.tp.parallelize_module}
MESH = {"stock": stock_mesh, "minddp": init_device_mesh}


def _ddp(who, model, mesh):
    return {"stock": DDP, "minddp": ManualDDP}[who](model, device_mesh=mesh["dp"])


def _fsdp(who, model, mesh, dp=("dp",)):
    shard = {"stock": stock_fully_shard, "minddp": minddp.fully_shard}[who]
    for block in model:
        shard(block, mesh=mesh[dp])
    return shard(model, mesh=mesh[dp])


def _hsdp(who, model, mesh):
    """fully_shard on the 2-D (dp_replicate, dp_shard) slice of a 3-D mesh, as torchtitan."""
    return _fsdp(who, model, mesh, ("dp_replicate", "dp_shard"))


def _no_sync(model, sync):
    """This microbatch's backward without the gradients' sync (accumulation), in each
    wrapper's own words: DDP's no_sync(), fully_shard's set_requires_gradient_sync."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()


# name: (tp plan, the data-parallel wrapper, each tp rank its slice of the sequence,
#        microbatches per step: all but the last without the gradients' sync)
COMPOSITIONS = {"ddp x tp": (TP_PLAN, _ddp, False, 1), "fsdp x tp+sp": (SP_PLAN, _fsdp, True, 1),
                "ddp x tp+sp, 2 microbatches": (SP_PLAN, _ddp, True, 2),
                "fsdp x tp+sp, 2 microbatches": (SP_PLAN, _fsdp, True, 2),
                "hsdp 2 x 1 x tp+sp, 2 microbatches": (SP_PLAN, _hsdp, True, 2),
                "hsdp 1 x 2 x tp+sp": (SP_PLAN, _hsdp, True, 1)}
EIGHT = {"hsdp 2 x 2 x tp+sp": (SP_PLAN, _hsdp, True, 1)}  # (in the 8-rank spawn)
# The mesh of each HSDP composition: fully_shard on the 2-D (dp_replicate, dp_shard) slice
HSDP_NAMES = ("dp_replicate", "dp_shard", "tp")
MESH_OF = {"hsdp 2 x 1 x tp+sp, 2 microbatches": ((2, 1, 2), HSDP_NAMES),
           "hsdp 1 x 2 x tp+sp": ((1, 2, 2), HSDP_NAMES),
           "hsdp 2 x 2 x tp+sp": ((2, 2, 2), HSDP_NAMES)}


def _composition(rank, world_size, name, steps=3):
    """A data-parallel wrapper over dp of TP over tp: parallelize_module first, as torchtitan.
    Accumulating over microbatches, SP's LayerNorm gradients are each rank's sum of its
    microbatches, then summed over tp once (stock keeps them Partial until they are read)."""
    plan, wrap, sequence, microbatches = {**COMPOSITIONS, **EIGHT}[name]
    torch.manual_seed(0)
    base = torch.nn.Sequential(Block(), Block())
    models, optimizers, named = {}, {}, {}
    for who in ("stock", "minddp"):
        shape, names = MESH_OF.get(name, ((2, 2), ("dp", "tp")))
        mesh = MESH[who]("cpu", shape, mesh_dim_names=names)
        model = copy.deepcopy(base)
        for block in model:
            PARALLELIZE[who](block, mesh["tp"], _plan(who, plan))
        models[who] = wrap(who, model, mesh)
        optimizers[who] = torch.optim.AdamW(models[who].parameters(), lr=1e-2, foreach=False)
        # Named now, once: stock's DDP over TP swaps each TP weight for a local Parameter,
        # and its forward sets a DTensor made from it in that Parameter's place (a plain
        # attribute, which named_parameters() no longer lists after the first forward).
        named[who] = dict(models[who].named_parameters())
    assert len(named["stock"]) == len(named["minddp"]) == len(list(base.parameters()))
    *dp, tp_rank = mesh.get_coordinate()
    dp_rank = dp[0] if len(dp) == 1 else dp[0] * mesh.shape[1] + dp[1]  # HSDP: row by row
    verdicts = []
    for step in range(steps):
        # each dp rank its own batch; the tp ranks of one dp rank share it
        xs = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(
            100 * step + 10 * micro + dp_rank)) for micro in range(microbatches)]
        if sequence:
            xs = [x.chunk(2, 1)[tp_rank].contiguous() for x in xs]
        seen = {}
        for who, model in models.items():
            optimizers[who].zero_grad()
            losses = []
            for micro, x in enumerate(xs):
                with _no_sync(model, micro == microbatches - 1):
                    loss = (model(x) ** 2).mean()
                    loss.backward()
                losses.append(loss.detach())
            loss = torch.stack(losses)
            grads = {n: _local(p.grad) for n, p in named[who].items()}
            optimizers[who].step()
            weights = {n: _local(p).detach().clone() for n, p in named[who].items()}
            seen[who] = (loss.detach(), grads, weights)
        verdicts.append(_differ(seen))
    return verdicts


def _pipelines(base, shape, names, parallelize, schedule, n_microbatches):
    """Stock's and minddp's pipeline on a mesh whose first dimension is pp: this rank's
    stage of `base`, parallelize(who, stage_module, mesh) applied to it, then the schedule."""
    library = {"stock": (stock_pipelining, stock_fully_shard),
               "minddp": (minddp.pp, minddp.fully_shard)}
    schedules, models, optimizers = {}, {}, {}
    for who, (pipelining, shard) in library.items():
        mesh = MESH[who]("cpu", shape, mesh_dim_names=names)
        pp_rank = mesh.get_local_rank("pp")
        stage_module = copy.deepcopy(minddp.pp.stage_layers(base, pp_rank, 2))
        parallelize(who, stage_module, mesh)
        if "dp" in names:
            shard(stage_module, mesh=mesh["dp"])
        stage = pipelining.PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"),
                                         group=mesh["pp"].get_group())
        schedules[who] = getattr(pipelining, schedule)(stage, n_microbatches,
                                                       loss_fn=torch.nn.functional.mse_loss)
        models[who] = stage_module
        optimizers[who] = torch.optim.AdamW(stage_module.parameters(), lr=1e-2, foreach=False)
    return schedules, models, optimizers, mesh


def _train_pipelines(built, batch_shapes, steps=3, sequence=False):
    """sequence: each tp rank its slice of the sequence (dim 1) of the batch and targets."""
    schedules, models, optimizers, mesh = built
    names = mesh.mesh_dim_names
    pp_rank = mesh.get_local_rank("pp")
    dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
    verdicts = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dp_rank)  # each dp rank its own batch
        x, y = (torch.randn(*shape, generator=g) for shape in batch_shapes)
        if sequence:
            tp_rank = mesh.get_local_rank("tp")
            x, y = (t.chunk(2, 1)[tp_rank].contiguous() for t in (x, y))
        seen = {}
        for who, schedule in schedules.items():
            optimizers[who].zero_grad()
            losses = []
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            grads = {n: _local(p.grad) for n, p in models[who].named_parameters()}
            optimizers[who].step()
            weights = {n: _local(p).detach().clone() for n, p in models[who].named_parameters()}
            seen[who] = (torch.stack(losses) if losses else None, grads, weights)
        verdicts.append(_differ(seen))
    return verdicts


def _pp_x_fsdp(rank, world_size):
    """PP over pp, FSDP over dp: each stage's layers fully_shard-ed on its dp group, as
    torchtitan: split into stages first, then parallelize each stage. GPipe."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))

    def parallelize(who, stage_module, mesh):
        shard = {"stock": stock_fully_shard, "minddp": minddp.fully_shard}[who]
        for layer in stage_module:
            if list(layer.parameters()):
                shard(layer, mesh=mesh["dp"])

    built = _pipelines(base, (2, 2), ("pp", "dp"), parallelize, "ScheduleGPipe", 4)
    return _train_pipelines(built, [(8, 8), (8, 4)])


CASES = [*COMPOSITIONS, "pp x fsdp", "1f1b x tp+sp, 4 microbatches",
         "1f1b x tp+sp, 4 microbatches, residual blocks, SGD with weight decay"]


def _pp_x_fsdp_x_tp(rank, world_size):
    """3-D, as torchtitan: split into stages (pp), TP on each stage's blocks (tp), then
    fully_shard (dp). 1F1B. Tiny sizes: 8 processes on 2 cores."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(Block() for _ in range(4)))

    def parallelize(who, stage_module, mesh):
        shard = {"stock": stock_fully_shard, "minddp": minddp.fully_shard}[who]
        for block in stage_module:
            PARALLELIZE[who](block, mesh["tp"], _plan(who, TP_PLAN))
            shard(block, mesh=mesh["dp"])

    built = _pipelines(base, (2, 2, 2), ("pp", "dp", "tp"), parallelize, "Schedule1F1B", 2)
    return _train_pipelines(built, [(4, 8, 16), (4, 8, 16)])


def _pp_x_sp(rank, world_size):
    """1F1B over pp, TP with sequence parallel over tp, 4 microbatches, 5 steps: the LayerNorms'
    gradients are each rank's sum over the microbatches, then summed over tp once."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(Block() for _ in range(4)))

    def parallelize(who, stage_module, mesh):
        for block in stage_module:
            PARALLELIZE[who](block, mesh["tp"], _plan(who, SP_PLAN))

    built = _pipelines(base, (2, 2), ("pp", "tp"), parallelize, "Schedule1F1B", 4)
    return _train_pipelines(built, [(8, 8, 16), (8, 8, 16)], steps=5, sequence=True)


class _Residual(torch.nn.Module):
    """x + ff(norm(x)): the block of stock's sequence-parallel docs, without attention."""

    def __init__(self, d=12, hidden=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(),
                                      torch.nn.Linear(hidden, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def _pp_x_sp_sgd(rank, world_size):
    """1F1B over pp, stock's documented SP plan over tp, SGD with momentum and weight decay:
    the decay's share is added to each rank's Partial LayerNorm gradient before its sum."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(_Residual() for _ in range(4)))
    plan = {"norm": "sp", "ff": "gather", "ff.0": "col", "ff.2": "row-sp"}

    def parallelize(who, stage_module, mesh):
        for block in stage_module:
            PARALLELIZE[who](block, mesh["tp"], _plan(who, plan))

    built = _pipelines(base, (2, 2), ("pp", "tp"), parallelize, "Schedule1F1B", 4)
    for who in built[2]:
        built[2][who] = torch.optim.SGD(built[1][who].parameters(), lr=0.1, momentum=0.9,
                                        weight_decay=0.01)
    return _train_pipelines(built, [(8, 6, 12), (8, 6, 12)], steps=5, sequence=True)


def _differ(seen):
    """The first three differences between stock's (loss, grads, weights) and minddp's."""
    (l_s, g_s, w_s), (l_m, g_m, w_m) = seen["stock"], seen["minddp"]
    if list(g_s) != list(g_m):
        return [f"names {sorted(set(g_s) ^ set(g_m))[:3]}"]
    same_loss = (l_s is None and l_m is None) or torch.equal(l_s, l_m)
    differ = ([] if same_loss else ["loss"]) + \
             [f"grad {n}" for n in g_s if not torch.equal(g_s[n], g_m[n])] + \
             [f"weight {n}" for n in w_s if not torch.equal(w_s[n], w_m[n])]
    return differ[:3] or "equal"


def _four(rank, world_size):
    cases = {name: _composition(rank, world_size, name, steps=3 if "micro" not in name else 5)
             for name in COMPOSITIONS}
    cases["pp x fsdp"] = _pp_x_fsdp(rank, world_size)
    cases["1f1b x tp+sp, 4 microbatches"] = _pp_x_sp(rank, world_size)
    cases["1f1b x tp+sp, 4 microbatches, residual blocks, SGD with weight decay"] = _pp_x_sp_sgd(rank, world_size)
    return {"groups": _groups(rank, world_size), **cases}


def _eight(rank, world_size):
    return {"groups": _groups(rank, world_size), "pp x fsdp x tp": _pp_x_fsdp_x_tp(rank, world_size),
            **{name: _composition(rank, world_size, name) for name in EIGHT}}


share_spawn(_four, [4])
share_spawn(_eight, [8])


def test_mesh_groups_are_init_device_meshs_at_4_ranks():
    for rank, result in enumerate(shared_results(_four, 4)):
        assert result["groups"] == [], f"rank {rank}"


def test_mesh_groups_are_init_device_meshs_at_8_ranks():
    for rank, result in enumerate(shared_results(_eight, 8)):
        assert result["groups"] == [], f"rank {rank}"


@pytest.mark.parametrize("name", ["pp x fsdp x tp", *EIGHT])
def test_a_composition_on_a_3d_mesh_of_8_is_bitwise_stocks(name):
    for rank, result in enumerate(shared_results(_eight, 8)):
        assert result[name] == ["equal"] * 3, f"{name}, rank {rank}: {result[name]}"


@pytest.mark.parametrize("name", CASES)
def test_a_composition_on_a_mesh_of_4_is_bitwise_stocks(name):
    for rank, result in enumerate(shared_results(_four, 4)):
        assert result[name] == ["equal"] * (5 if "micro" in name else 3), f"{name}, rank {rank}"


def test_grid_groups_are_lines_through_the_grid():
    assert grid_groups((2, 2), 0) == [[0, 2], [1, 3]]  # dp: columns
    assert grid_groups((2, 2), 1) == [[0, 1], [2, 3]]  # tp: rows
    assert grid_groups((2, 2, 2), 0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # every dimension's groups cover every rank exactly once
    for shape in itertools.chain(*SHAPES.values()):
        for dim in range(len(shape)):
            ranks = sorted(sum(grid_groups(shape, dim), []))
            assert ranks == list(range(math.prod(shape))), (shape, dim)


@pytest.mark.parametrize("shape, names, world_size, message", [
    ((2, 2), ("dp", "tp"), 8, "a mesh of dp=2, tp=2 holds 4 ranks, but the world has 8"),
    ((2, 2), ("dp",), 4, "mesh_dim_names has 1 names for a 2-D mesh (dp=2, ?=2)"),
    ((2, 2), ("dp", "dp"), 4, "mesh dimension names repeat: ('dp', 'dp')"),
    ((0, 4), ("dp", "tp"), 4, "mesh shape (0, 4): every dimension needs at least one rank"),
])
def test_a_mesh_that_does_not_fit_is_one_line_before_any_group(shape, names, world_size, message):
    with pytest.raises(UsageError) as error:
        check_mesh(shape, names, world_size)
    assert error.value.message == message
    assert error.value.same_on_every_rank


def test_an_unknown_dimension_names_the_known_ones():
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"), groups=[None, None], rank=3)
    assert mesh.get_coordinate() == [1, 1]
    assert mesh["tp"].mesh.tolist() == [2, 3]
    with pytest.raises(UsageError, match=r"mesh dimension 'pp' is not one of \('dp', 'tp'\)"):
        mesh["pp"]
    with pytest.raises(UsageError, match="get_group\\(\\) on a 2-D mesh"):
        mesh.get_group()
    assert mesh["dp", "tp"].mesh.tolist() == [[0, 1], [2, 3]]
    assert mesh[("dp", "tp")].get_coordinate() == [1, 1]
    with pytest.raises(UsageError, match=r"^mesh\[\('tp', 'dp'\)\]: dimensions go in the mesh"):
        mesh["tp", "dp"]  # stock refuses it too (a KeyError)


def test_ddp_takes_a_1d_mesh_and_refuses_what_stock_refuses():
    from minddp.dropin.checks import group_of
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"), groups=["dp group", "tp group"], rank=1)
    assert group_of(None, mesh["dp"]) == "dp group"  # rank 1's dp slice: its group
    assert group_of("a group", None) == "a group"
    with pytest.raises(UsageError, match=r"^Only 1D device mesh is supported, but got DeviceMesh"):
        group_of(None, mesh)
    with pytest.raises(UsageError, match="^Cannot specify both process_group and device_mesh"):
        group_of("a group", mesh["dp"])
