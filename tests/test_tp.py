"""Tensor parallelism by hand (minddp/tp.py) against PyTorch's parallelize_module, bit for bit.

    pytest tests/test_tp.py

One spawn per world size runs every case twice, from the same weights and batches: once with
stock `torch.distributed.tensor.parallel.parallelize_module`, once with minddp's. After each
of 3 AdamW steps, on every rank: the output, the input's gradient, every parameter's gradient
(stock's `to_local()`: this rank's slice, or the whole of a replicated one) and every updated
parameter must be `torch.equal`. Each case is a test of its own; a world size's cases share
its spawn.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed import tensor as stock_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as stock_tp
from torch.distributed.tensor.parallel import ColwiseParallel as StockColwise
from torch.distributed.tensor.parallel import RowwiseParallel as StockRowwise
from torch.distributed.tensor.parallel import parallelize_module as stock_parallelize

from helpers import share_spawn, shared_results, usage_errors
from minddp import ManualDDP
import minddp.sp
import minddp.tp
from minddp.bench.transformer import MLP, Attention, Block  # the benchmark's, small here
from minddp.tp import ColwiseParallel, parallelize_module


PLANS = {  # model: (build, input shape, {submodule: style}, sequence parallel)
    "mlp": (MLP, (4, 8), {"up": "col", "down": "row"}, False),
    "mlp-nobias": (lambda: MLP(bias=False), (4, 8), {"up": "col", "down": "row"}, False),
    "block": (Block, (2, 8, 16), {"attn.q": "col", "attn.k": "col", "attn.v": "col",
                                  "attn.o": "row", "mlp.up": "col", "mlp.down": "row"}, False),
    # Sequence parallel: the LayerNorms on each rank's tokens, gathered before the column
    # splits (PrepareModuleInput), reduce-scattered after the row splits.
    "block-sp": (Block, (2, 8, 16), {"ln1": "sp", "attn": "gather", "attn.q": "col",
                                     "attn.k": "col", "attn.v": "col", "attn.o": "row-sp",
                                     "ln2": "sp", "mlp": "gather", "mlp.up": "col",
                                     "mlp.down": "row-sp"}, True),
}


def _style(library, name):
    tp = {"stock": stock_tp, "minddp": minddp.tp}[library]
    sp = {"stock": stock_tp, "minddp": minddp.sp}[library]
    return {"col": lambda: tp.ColwiseParallel(), "row": lambda: tp.RowwiseParallel(),
            "row-sp": lambda: tp.RowwiseParallel(output_layouts=Shard(1)),
            "sp": lambda: sp.SequenceParallel(),
            "gather": lambda: sp.PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),))}[name]()


def _local(t):
    """This rank's part; a Partial gradient (stock's, under sequence parallel) made whole."""
    if isinstance(t, stock_tensor.DTensor) and t.placements[0].is_partial():
        t = t.redistribute(placements=[Replicate()])
    return t.to_local() if hasattr(t, "to_local") else t


def _case(rank, world_size, name, steps=3):
    build, shape, plan, sequence = PLANS[name]
    torch.manual_seed(0)
    base = build()
    mesh = init_device_mesh("cpu", (world_size,))
    models, optimizers = {}, {}
    for who, parallelize in (("stock", stock_parallelize), ("minddp", parallelize_module)):
        model = copy.deepcopy(base)
        parallelize(model, mesh, {n: _style(who, s) for n, s in plan.items()})
        models[who] = model
        optimizers[who] = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                            foreach=False)
    verdicts = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
        x = torch.randn(*shape, generator=g)
        if sequence:  # each rank its slice of the sequence (dim 1)
            x = x.chunk(world_size, 1)[rank].contiguous()
        seen = {}
        for who, model in models.items():
            xi = x.clone().requires_grad_()
            optimizers[who].zero_grad()
            out = model(xi)
            (out.float() ** 2).mean().backward()
            grads = {n: _local(p.grad) for n, p in model.named_parameters()}
            optimizers[who].step()
            weights = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
            seen[who] = (out.detach(), xi.grad, grads, weights)
        (out_s, dx_s, g_s, w_s), (out_m, dx_m, g_m, w_m) = seen["stock"], seen["minddp"]
        differ = ([] if torch.equal(out_s, out_m) else ["output"]) + \
                 ([] if torch.equal(dx_s, dx_m) else ["input grad"]) + \
                 [f"grad {n}" for n in g_s if not torch.equal(g_s[n], g_m[n])] + \
                 [f"weight {n}" for n in w_s if not torch.equal(w_s[n], w_m[n])]
        verdicts.append(differ[:2] or "equal")
    return verdicts


def _mistakes(rank, world_size):
    return usage_errors({
            "not in the model": lambda: parallelize_module(MLP(), None, {"nope": ColwiseParallel()}),
            "not a Linear": lambda: parallelize_module(Block(), None, {"ln1": ColwiseParallel()}),
            "uneven": lambda: parallelize_module(MLP(hidden=10 + 1), None,
                                                 {"up": ColwiseParallel()}),
            "wrapped": lambda: parallelize_module(ManualDDP(MLP()), None,
                                                  {"module.up": ColwiseParallel()}),
            "heads": lambda: parallelize_module(Attention(d=8, heads=1), None,
                                                {"q": ColwiseParallel()})}.items())


def _textbook_bias(rank, world_size):
    """The row split's bias added once, after the all_reduce: how far from stock's output?"""
    from minddp.tp import copy_to_ranks, sum_over_ranks
    torch.manual_seed(0)
    base = MLP()
    stock = copy.deepcopy(base)
    stock_parallelize(stock, init_device_mesh("cpu", (world_size,)),
                      {"up": StockColwise(), "down": StockRowwise()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    n = 16 // world_size
    up_w, up_b = base.up.weight[rank * n:(rank + 1) * n], base.up.bias[rank * n:(rank + 1) * n]
    h = F.gelu(F.linear(copy_to_ranks(x), up_w, up_b))
    textbook = sum_over_ranks(F.linear(h, base.down.weight[:, rank * n:(rank + 1) * n])) \
        + base.down.bias
    with torch.no_grad():
        out = stock(x)
        return torch.equal(textbook, out), (textbook - out).abs().max().item()


def _everything(rank, world_size):
    return {"cases": {name: _case(rank, world_size, name) for name in PLANS},
            "mistakes": _mistakes(rank, world_size),
            "textbook": _textbook_bias(rank, world_size)}


share_spawn(_everything, [2, 4])


def _results(world_size):
    return shared_results(_everything, world_size)


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_bitwise_equal_to_parallelize_module(world_size, name):
    for rank, out in enumerate(_results(world_size)):
        assert out["cases"][name] == ["equal"] * 3, f"rank {rank}: {out['cases'][name]}"


@pytest.mark.parametrize("mistake,message", [
    ("not in the model", "the plan names 'nope', which MLP does not have"),
    ("not a Linear", "'ln1' is a LayerNorm, not an nn.Linear"),
    ("uneven", "'up': weight dimension 0 has 11 entries, which 2 ranks cannot share equally"),
    ("wrapped", "parallelize_module on a model already wrapped for data parallelism"),
    ("heads", "'q': 4 output features per rank is not a whole number of heads of 8")])
def test_a_wrong_plan_is_one_line_before_any_collective(mistake, message):
    for out in _results(2):
        assert out["mistakes"][mistake] is not None and message in out["mistakes"][mistake]


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_textbook_bias_placement_is_not_stocks(world_size):
    # Adding the row split's bias after the all_reduce is the same sum in another order:
    # a rounding unit or so off stock, which adds bias / world_size on each rank before it.
    for equal, gap in (out["textbook"] for out in _results(world_size)):
        assert not equal and 0 < gap < 1e-6, gap
