"""Tensor parallelism by hand (minddp/tp/parallel.py) against PyTorch's parallelize_module, bit for bit.

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
import minddp.tp.sequence_parallel
import minddp.tp
from minddp.bench.transformer import MLP, Attention, Block  # the benchmark's, small here
from minddp.tp import ColwiseParallel, parallelize_module


class OpBeforeSplits(Attention):
    """Attention that computes something from its (gathered) input before q, k and v."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return super().forward(self.op(x))


class CrossAttention(Attention):
    """q from the (gathered) input, k and v from a whole memory that no gather made."""

    def forward(self, x, memory):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k, v = (lin(memory).view(B, memory.shape[1], -1, self.head_dim).transpose(1, 2)
                for lin in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class CrossBlock(torch.nn.Module):
    """A LayerNorm, then cross-attention to a memory an encoder outside the plan computes."""

    def __init__(self, d=16):
        super().__init__()
        self.ln, self.attn, self.encoder = torch.nn.LayerNorm(d), CrossAttention(d), \
            torch.nn.Linear(d, d)
        self.register_buffer("context", torch.randn(2, 6, d))

    def forward(self, x):
        return x + self.attn(self.ln(x), self.encoder(self.context))


class WithHead(torch.nn.Module):
    """A block and a layer outside the plan: stock leaves that layer's weights as they are."""

    def __init__(self, block):
        super().__init__()
        self.block, self.head = block, torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.block(x))


def _block_with(op):
    block = Block()
    attention = OpBeforeSplits(op)
    attention.load_state_dict(block.attn.state_dict())
    block.attn = attention
    return block


OPS = {"scale": lambda: (lambda x: x * 0.5), "dropout": lambda: torch.nn.Dropout(0.25),
       "dropout-eval": lambda: torch.nn.Dropout(0.25).eval(),
       "cast": lambda: (lambda x: x.to(torch.bfloat16).to(torch.float32))}
SP_BLOCK = {"ln1": "sp", "attn": "gather", "attn.q": "col", "attn.k": "col", "attn.v": "col",
            "attn.o": "row-sp", "ln2": "sp", "mlp": "gather", "mlp.up": "col",
            "mlp.down": "row-sp"}
PLANS = {  # model: (build, input shape, {submodule: style}, sequence parallel, per-rank init)
    "mlp": (MLP, (4, 8), {"up": "col", "down": "row"}, False, False),
    "mlp-nobias": (lambda: MLP(bias=False), (4, 8), {"up": "col", "down": "row"}, False, False),
    "block": (Block, (2, 8, 16), {"attn.q": "col", "attn.k": "col", "attn.v": "col",
                                  "attn.o": "row", "mlp.up": "col", "mlp.down": "row"},
              False, False),
    # Sequence parallel: the LayerNorms on each rank's tokens, gathered before the column
    # splits (PrepareModuleInput), reduce-scattered after the row splits.
    "block-sp": (Block, (2, 8, 16), SP_BLOCK, True, False),
    # Wildcards, as stock's plans write them: "attn.*" is q, k, v and o.
    "block-wildcards": (Block, (2, 8, 16), {"attn.[qkv]": "col", "attn.o": "row",
                                            "*.up": "col", "mlp.dow?": "row"}, False, False),
    # An op between the gather and the column splits: their gradient is still summed once.
    **{f"block-sp-{op}": (lambda op=op: _block_with(OPS[op]()), (2, 8, 16), SP_BLOCK, True,
                          False) for op in OPS},
    # k and v from a tensor no gather made, beside q from the gathered input.
    "cross-sp": (CrossBlock, (2, 8, 16), {"ln": "sp", "attn": "gather-first", "attn.q": "col",
                                          "attn.k": "col", "attn.v": "col", "attn.o": "row-sp"},
                 True, False),
    # Every rank its own weights: the plan's layers take rank 0's, the others stay each rank's.
    "mlp-per-rank": (lambda: WithHead(MLP(16)), (4, 16), {"block.up": "col", "block.down": "row"},
                     False, True),
    "block-sp-per-rank": (lambda: WithHead(Block()), (2, 8, 16),
                          {f"block.{n}": s for n, s in SP_BLOCK.items()}, True, True),
    # src_data_rank=None (stock's keyword): each rank's slices of its own weights, no broadcast.
    "mlp-per-rank-own-weights": (lambda: WithHead(MLP(16)), (4, 16),
                                 {"block.up": "col", "block.down": "row"}, False, None),
}


def _style(library, name):
    tp = {"stock": stock_tp, "minddp": minddp.tp}[library]
    sp = {"stock": stock_tp, "minddp": minddp.tp.sequence_parallel}[library]
    return {"col": lambda: tp.ColwiseParallel(), "row": lambda: tp.RowwiseParallel(),
            "row-sp": lambda: tp.RowwiseParallel(output_layouts=Shard(1)),
            "sp": lambda: sp.SequenceParallel(),
            "gather": lambda: sp.PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
            "gather-first": lambda: sp.PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            }[name]()


def _local(t):
    """This rank's part; a Partial gradient (stock's, under sequence parallel) made whole."""
    if isinstance(t, stock_tensor.DTensor) and t.placements[0].is_partial():
        t = t.redistribute(placements=[Replicate()])
    return t.to_local() if hasattr(t, "to_local") else t


# Optimizers that read a gradient otherwise than AdamW does: each adds to it before the sum
# over tp that stock makes of a Partial one (sequence parallel's LayerNorms) when it is read.
OPTIMIZERS = {
    "sgd weight_decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam weight_decay": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01,
                                                     foreach=False)}


def _case(rank, world_size, name, steps=3, optimizer=None):
    build, shape, plan, sequence, per_rank = PLANS[name]  # per_rank None: and no broadcast
    torch.manual_seed(0 if per_rank is False else rank)
    keywords = {"src_data_rank": None} if per_rank is None else {}
    base = build()
    mesh = init_device_mesh("cpu", (world_size,))
    models, optimizers = {}, {}
    for who, parallelize in (("stock", stock_parallelize), ("minddp", parallelize_module)):
        model = copy.deepcopy(base)
        parallelize(model, mesh, {n: _style(who, s) for n, s in plan.items()}, **keywords)
        models[who] = model
        optimizers[who] = (OPTIMIZERS[optimizer](model.parameters()) if optimizer else
                           torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                             foreach=False))
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
            torch.manual_seed(1000 + step)  # a dropout draws the same mask in both
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
        verdicts.append(differ[:3] or "equal")
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
                                                {"q": ColwiseParallel()}),
            "local output": lambda: ColwiseParallel(use_local_output=False),
            "col output layout": lambda: ColwiseParallel(output_layouts=Replicate()),
            "row input layout": lambda: minddp.tp.RowwiseParallel(input_layouts=Replicate()),
            "gather kept local": lambda: minddp.tp.sequence_parallel.PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True),
            "mixed input": lambda: _mixed(rank, world_size, "minddp"),
            "sp on a block": lambda: parallelize_module(
                Block(), None, {"mlp": minddp.tp.sequence_parallel.SequenceParallel()})}.items())


class Scaled(Attention):
    """q, k and v from the gathered input times a weight outside the plan: stock refuses."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        return super().forward(x * self.scale)


def _mixed(rank, world_size, who):
    """Run Scaled under `who`'s plan: stock's error message, or minddp's UsageError raised."""
    plan = {"": "gather", "q": "col", "k": "col", "v": "col", "o": "row-sp"}
    parallelize = {"stock": stock_parallelize, "minddp": parallelize_module}[who]
    model = parallelize(Scaled(), init_device_mesh("cpu", (world_size,)),
                        {n: _style(who, s) for n, s in plan.items()})
    try:
        model(torch.randn(2, 8 // world_size, 16, requires_grad=True))
    except RuntimeError as e:
        if who == "minddp":
            raise
        return str(e)
    return None


def _single_style(rank, world_size):
    """A style alone as the plan: the model itself is split (stock's shortcut)."""
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 16)
    shapes = []
    for parallelize, style in ((stock_parallelize, StockColwise()),
                               (parallelize_module, ColwiseParallel())):
        model = parallelize(copy.deepcopy(base), init_device_mesh("cpu", (world_size,)), style)
        shapes.append(_local(model.weight).detach().clone())
    return torch.equal(*shapes), tuple(shapes[1].shape)


def _textbook_bias(rank, world_size):
    """The row split's bias added once, after the all_reduce: how far from stock's output?"""
    from minddp.tp.ops import copy_to_ranks, sum_over_ranks
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
            "optimizers": {o: _case(rank, world_size, "block-sp", optimizer=o) for o in OPTIMIZERS},
            "mistakes": _mistakes(rank, world_size),
            "single style": _single_style(rank, world_size),
            "mixed stock": _mixed(rank, world_size, "stock"),
            "textbook": _textbook_bias(rank, world_size)}


share_spawn(_everything, [2, 4])


def _results(world_size):
    return shared_results(_everything, world_size)


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_bitwise_equal_to_parallelize_module(world_size, name):
    for rank, out in enumerate(_results(world_size)):
        assert out["cases"][name] == ["equal"] * 3, f"rank {rank}: {out['cases'][name]}"


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_is_stocks_under_an_optimizer_that_adds_to_the_gradient(
        world_size, optimizer):
    # Stock's LayerNorm gradient is Partial until read: weight_decay's share of the weight,
    # or Nesterov's of the momentum, is added to each rank's part before the sum over tp.
    for rank, out in enumerate(_results(world_size)):
        assert out["optimizers"][optimizer] == ["equal"] * 3, (rank, out["optimizers"][optimizer])


@pytest.mark.parametrize("mistake,message", [
    ("not in the model", "the plan names 'nope', which MLP does not have"),
    ("not a Linear", "'ln1' is a LayerNorm, not an nn.Linear"),
    ("uneven", "'up': weight dimension 0 has 11 entries, which 2 ranks cannot share equally"),
    ("wrapped", "parallelize_module on a model already wrapped for data parallelism"),
    ("heads", "'q': 4 output features per rank is not a whole number of heads of 8"),
    ("local output", "ColwiseParallel(use_local_output=False) is not implemented"),
    ("col output layout", "ColwiseParallel(output_layouts=Replicate()) is not implemented"),
    ("row input layout", "RowwiseParallel(input_layouts=Replicate()) is not implemented"),
    ("gather kept local", "PrepareModuleInput is implemented for input_layouts=Shard(d)"),
    ("mixed input", "'q': its input mixes the gathered input with other tensors"),
    ("sp on a block", "SequenceParallel on 'mlp': its submodules hold up.weight")])
def test_a_wrong_plan_is_one_line_before_any_collective(mistake, message):
    for out in _results(2):
        assert out["mistakes"][mistake] is not None and message in out["mistakes"][mistake]


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_textbook_bias_placement_is_not_stocks(world_size):
    # Adding the row split's bias after the all_reduce is the same sum in another order:
    # a rounding unit or so off stock, which adds bias / world_size on each rank before it.
    for equal, gap in (out["textbook"] for out in _results(world_size)):
        assert not equal and 0 < gap < 1e-6, gap


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_style_alone_splits_the_model_itself(world_size):
    for rank, out in enumerate(_results(world_size)):
        assert out["single style"] == (True, (16 // world_size, 8)), (rank, out["single style"])


def test_stock_refuses_the_mixed_input_minddp_refuses():
    for out in _results(2):
        assert "mixed torch.Tensor and DTensor" in (out["mixed stock"] or ""), out["mixed stock"]
