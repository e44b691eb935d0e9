"""minddp's fully_shard (FSDP by hand) against PyTorch's fully_shard, bit for bit.

    pytest tests/test_fsdp.py

One spawn per world size runs every case: the same model, the same batches, once under
stock `fully_shard` and once under minddp's; after every step each rank's shards must be
`torch.equal` to stock's `to_local()`. foreach=False on both sides (the for-loop kernels; on
CPU that is the default anyway). Each case is a test of its own, named on failure; the
cases of one world size share that world size's spawn. "minddp" is `minddp.fully_shard`
(the drop-in), "lesson" the lecture's `minddp.fsdp.shard.fully_shard` under it (fp32 cases).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as StockPolicy
from torch.distributed.fsdp import fully_shard as stock_fully_shard

from helpers import share_spawn, shared_results, usage_errors
from minddp import ManualDDP
from minddp import MixedPrecisionPolicy, fully_shard
from minddp.fsdp.shard import fully_shard as lesson_fully_shard
from minddp.tools.whole_tensors import full_gradients, full_state_dict, load_full_state_dict


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=11, d=8, context=5, layers=2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def mlp():  # row counts 7, 5, 3: none divides by 2 or 4
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def frozen():  # the first layer frozen, a unit of its own
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    model[0].requires_grad_(False)
    return model


def tied():  # a language model whose output layer is its embedding: one weight, two users
    model = TinyLM()
    model.head.weight = model.embed.weight
    return model


MODELS = {"mlp": (mlp, lambda m: [m[0], m[2], m[4]]),
          "lm": (TinyLM, lambda m: list(m.blocks)),
          "tied": (tied, lambda m: list(m.blocks)),  # the tied weight in the root unit
          "frozen": (frozen, lambda m: [m[0], m[2]]),
          # the input itself needs a gradient (a leaf): a pipeline stage's received
          # activation, or a saliency map; the first unit's weights must still be reduced
          "mlp-input-grad": (mlp, lambda m: [m[0], m[2], m[4]])}
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False})}


def _batch(name, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    if name in ("lm", "tied"):
        idx = torch.randint(0, 11, (3, 5), generator=g)
        return idx, torch.randint(0, 11, (3, 5), generator=g)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    return (x.requires_grad_() if name == "mlp-input-grad" else x), y


def _loss(name, out, target):
    if name in ("lm", "tied"):
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out.float(), target)


def _shard_both(name, reshard, bf16, ours):
    """The same model twice: sharded by stock fully_shard, and by minddp's (or the lesson's)."""
    build, units = MODELS[name]
    torch.manual_seed(0)
    base = build()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    shards = [(stock_fully_shard, StockPolicy), (fully_shard, MixedPrecisionPolicy)]
    for model, (shard, policy) in zip(models, shards):
        mp = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else policy()
        if ours == "lesson" and shard is fully_shard:  # fp32: the lecture takes no policy
            shard = lambda m, mp_policy, **kw: lesson_fully_shard(m, **kw)  # noqa: E731
        for unit in units(model):
            shard(unit, reshard_after_forward=reshard, mp_policy=mp)
        shard(model, mp_policy=mp)  # the root: stock's default reshard setting
    return models


def _case(rank, name, opt, reshard, bf16, ours, steps=3):
    """Per step: are this rank's shards equal to stock's? The first differing name, if not."""
    models = _shard_both(name, reshard, bf16, ours)
    cls, kwargs = OPTIMIZERS[opt]
    optimizers = [cls(m.parameters(), **kwargs) for m in models]
    verdicts = []
    for step in range(steps):
        x, y = _batch(name, step, rank)
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            _loss(name, model(x), y).backward()
            optimizer.step()
        stock = dict(models[0].named_parameters())
        ours = dict(models[1].named_parameters())
        differ = [n for n in stock if not torch.equal(stock[n].to_local(), ours[n].to_local())]
        verdicts.append(differ[:1] or "equal")
    return verdicts


CASES = [("mlp", "sgd", True, False, "minddp"), ("mlp", "adamw", True, False, "minddp"),
         ("mlp", "sgd", False, False, "minddp"), ("mlp", "adamw", False, False, "minddp"),
         ("lm", "adamw", True, False, "minddp"), ("lm", "sgd", False, False, "minddp"),
         ("frozen", "sgd", True, False, "minddp"), ("frozen", "adamw", False, False, "minddp"),
         ("mlp", "adamw", True, True, "minddp"), ("lm", "adamw", True, True, "minddp"),
         ("lm", "sgd", False, True, "minddp"), ("tied", "adamw", True, False, "minddp"),
         ("mlp", "adamw", True, False, "lesson"), ("lm", "sgd", False, False, "lesson"),
         ("mlp-input-grad", "adamw", True, False, "minddp"),
         ("mlp-input-grad", "sgd", False, False, "lesson")]


def _case_id(case):
    name, opt, reshard, bf16, ours = case
    return (f"{ours}-{name}-{opt}-{'reshard' if reshard else 'no_reshard'}"
            f"{'-bf16' if bf16 else ''}")


def _against_ddp(rank, world_size):
    """fully_shard's gathered weights vs ManualDDP's, on the MLP, SGD and AdamW."""
    verdicts = {}
    for opt in OPTIMIZERS:
        cls, kwargs = OPTIMIZERS[opt]
        torch.manual_seed(0)
        base = mlp()
        ddp, sharded = ManualDDP(copy.deepcopy(base)), copy.deepcopy(base)
        for unit in (sharded[0], sharded[2], sharded[4], sharded):
            fully_shard(unit)
        optimizers = [cls(m.parameters(), **kwargs) for m in (ddp, sharded)]
        for step in range(3):
            x, y = _batch("mlp", step, rank)
            for model, optimizer in zip((ddp, sharded), optimizers):
                optimizer.zero_grad()
                F.mse_loss(model(x), y).backward()
                optimizer.step()
        whole = full_state_dict(sharded)
        verdicts[opt] = all(torch.equal(whole[n], t) for n, t in ddp.module.state_dict().items())
    return verdicts


def _whole_tensors(rank):
    """full_state_dict and full_gradients vs stock's full_tensor(); a save/load round trip."""
    models = _shard_both("lm", True, False, "minddp")
    x, y = _batch("lm", 0, rank)
    for model in models:
        _loss("lm", model(x), y).backward()
    stock_weights = {n: p.full_tensor() for n, p in models[0].named_parameters()}
    stock_grads = {n: p.grad.full_tensor() for n, p in models[0].named_parameters()}
    weights, grads = full_state_dict(models[1]), full_gradients(models[1])
    weights_differ = [n for n, t in stock_weights.items() if not torch.equal(weights[n], t)]
    grads_differ = [n for n, t in stock_grads.items() if not torch.equal(grads[n], t)]
    # Load the whole weights into a model sharded from other weights: the same shards again.
    torch.manual_seed(1)
    other = TinyLM()
    for unit in list(other.blocks) + [other]:
        fully_shard(unit)
    load_full_state_dict(other, weights)
    ours = dict(models[1].named_parameters())
    reloaded_differ = [n for n, p in other.named_parameters()
                       if not torch.equal(p.to_local(), ours[n].to_local())]
    return {"weights differ from full_tensor()": weights_differ,
            "gradients differ from full_tensor()": grads_differ,
            "reloaded shards differ": reloaded_differ,
            "entries missing": sorted(set(stock_weights) - set(weights))}


def _mistakes(rank):
    """Each mistake raises one UsageError on every rank (none hangs); the messages."""
    def optimizer_first():
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        fully_shard(model)
        F.mse_loss(model(torch.randn(2, 6)), torch.randn(2, 3)).backward()
        optimizer.step()

    def twice():
        model = mlp()
        fully_shard(model)
        fully_shard(model)

    def tied_across_units():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        fully_shard(model[0])
        fully_shard(model)

    def differ_across_ranks():
        fully_shard(nn.Linear(6, 7 + rank))

    def mixed_dtypes():
        fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))

    return usage_errors([("optimizer_first", optimizer_first), ("twice", twice),
                         ("tied_across_units", tied_across_units),
                         ("differ_across_ranks", differ_across_ranks),
                         ("mixed_dtypes", mixed_dtypes)])


def _everything(rank, world_size):
    out = {"cases": {case: _case(rank, *case) for case in CASES}}
    if world_size <= 2:
        out["ddp"] = _against_ddp(rank, world_size)
    if world_size == 2:
        out["whole"] = _whole_tensors(rank)
        out["mistakes"] = _mistakes(rank)
    return out


share_spawn(_everything, [1, 2, 3, 4])  # one spawn per world size serves all its tests


def _results(world_size):
    return shared_results(_everything, world_size)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fully_shard_bitwise_equal_to_stock(world_size, case):
    for rank, out in enumerate(_results(world_size)):
        assert out["cases"][case] == ["equal"] * 3, f"rank {rank}: {out['cases'][case]}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_whole_weights_equal_manual_ddps(world_size):
    # DDP multiplies by 1/world_size before summing, FSDP sums then divides: at 1 and 2
    # ranks both are exact, so the whole weights agree bit for bit.
    for out in _results(world_size):
        assert out["ddp"] == {"sgd": True, "adamw": True}, out["ddp"]


def test_whole_tensors_equal_stocks_full_tensor():
    for out in _results(2):
        assert all(names == [] for names in out["whole"].values()), out["whole"]


@pytest.mark.parametrize("mistake,message", [
    ("optimizer_first", "SGD holds a parameter of shape [7, 6] that fully_shard replaced"),
    ("twice", "already applied"),
    ("tied_across_units", "'1.weight' is shared with an inner fully_shard unit"),
    ("differ_across_ranks", "rank 1's model differs from rank 0's at parameter #0"),
    ("mixed_dtypes", "mixes parameter dtypes ['torch.float32', 'torch.float64']")])
def test_a_mistake_is_one_line(mistake, message):
    for out in _results(2):
        assert message in out["mistakes"][mistake], out["mistakes"][mistake]
    if mistake == "optimizer_first":
        assert "build the optimizer" in out["mistakes"][mistake]
