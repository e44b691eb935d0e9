"""minddp's fully_shard (FSDP by hand) against PyTorch's fully_shard, bit for bit.

    pytest tests/test_fsdp.py
    pytest tests/test_fsdp.py -k hsdp    # on a 2-D mesh (HSDP), 4 ranks

One spawn per world size runs every case: the same model, the same batches, once under
stock `fully_shard` and once under minddp's; after every step each rank's shards must be
`torch.equal` to stock's `to_local()`. foreach=False on both sides (the for-loop kernels; on
CPU that is the default anyway). Each case is a test of its own, named on failure; the
cases of one world size share that world size's spawn. "minddp" is `minddp.fully_shard`
(the drop-in), "lesson" the lecture's `minddp.fsdp.shard.fully_shard` under it (fp32 cases).
HSDP (dropin/hsdp.py): at 4 ranks, fully_shard on a 2-D mesh (dp_replicate, dp_shard) of
2 x 2, 1 x 4 and 4 x 1, each data-parallel rank its own batches, beside stock's: after each
AdamW step the loss, every rank's gradient blocks, shards and their placements equal.
"""

import atexit
import copy
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as StockPolicy
from torch.distributed.fsdp import fully_shard as stock_fully_shard

from helpers import share_spawn, shared_results, usage_errors
from minddp import ManualDDP
from minddp import MixedPrecisionPolicy, UsageError, fully_shard
from minddp.bench.transformer import Block as GPTBlock
from minddp.fsdp.shard import fully_shard as lesson_fully_shard
from minddp.mesh.device_mesh import DeviceMesh, init_device_mesh
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


# HSDP: minddp.fully_shard on a 2-D mesh (dim 0 replicates, dim 1 shards) beside stock's.
HSDP_NAMES = ("dp_replicate", "dp_shard")
HSDP_MODELS = {"mlp": (mlp, lambda m: [m[0], m[2], m[4]]),  # rows 7, 5, 3: padded at 2 and 4
               "mlp-fp16": (lambda: mlp().half(), lambda m: [m[0], m[2], m[4]]),
               "blocks": (lambda: nn.Sequential(GPTBlock(), GPTBlock()), list)}
# (model, mesh shape, variant): fp32; bf16 compute, fp32 reduce; 2 microbatches a step, the
# first with set_requires_gradient_sync(False); the blocks kept whole after forward
HSDP_CASES = [("mlp", (2, 2), "fp32"), ("mlp", (2, 2), "bf16"), ("mlp", (2, 2), "microbatches"),
              ("blocks", (2, 2), "fp32"), ("blocks", (2, 2), "bf16"),
              ("blocks", (2, 2), "microbatches"), ("blocks", (2, 2), "bf16-microbatches"),
              ("blocks", (2, 2), "no_reshard"),
              ("mlp", (1, 4), "fp32"), ("blocks", (1, 4), "fp32"), ("mlp", (4, 1), "fp32"),
              ("blocks", (4, 1), "fp32"), ("blocks", (4, 1), "bf16"),
              ("blocks", (4, 1), "microbatches")]


def _hsdp_both(name, shape, variant):
    """The same model twice, on a 2-D mesh: sharded by stock's fully_shard, then minddp's."""
    build, units = HSDP_MODELS[name]
    torch.manual_seed(0)
    base = build()
    models = []
    for shard, policy, make_mesh in ((stock_fully_shard, StockPolicy, stock_mesh),
                                     (fully_shard, MixedPrecisionPolicy, init_device_mesh)):
        mesh = make_mesh("cpu", shape, mesh_dim_names=HSDP_NAMES)
        bf16 = "bf16" in variant
        mp = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else policy()
        model = copy.deepcopy(base)
        for unit in units(model):
            shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=variant != "no_reshard")
        models.append(shard(model, mesh=mesh, mp_policy=mp))
    return models


def _hsdp_batch(name, step, micro, rank):
    """Data-parallel rank `rank`'s batch (the mesh spans the world: its global rank)."""
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    if name == "blocks":
        return torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _hsdp_seen(model):
    """This rank's gradient blocks, shards and their placements, as they are now."""
    return ({n: p.grad.to_local().clone() for n, p in model.named_parameters()},
            {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            {n: (p.placements, p.device_mesh.mesh.tolist(), p.shape)
             for n, p in model.named_parameters()})


def _hsdp_case(rank, name, shape, variant, steps=3):
    """Per AdamW step: the first differences between stock's and minddp's, or "equal"."""
    models = _hsdp_both(name, shape, variant)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
                  for m in models]
    microbatches = 2 if "microbatches" in variant else 1
    verdicts = []
    for step in range(steps):
        seen = []
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            losses = []
            for micro in range(microbatches):
                model.set_requires_gradient_sync(micro == microbatches - 1)
                x, y = _hsdp_batch(name, step, micro, rank)
                loss = F.mse_loss(model(x).float(), y)
                loss.backward()
                losses.append(loss.detach())
            grads = _hsdp_seen(model)[0]
            optimizer.step()
            seen.append((torch.stack(losses), grads, *_hsdp_seen(model)[1:]))
        (loss_s, grads_s, shards_s, where_s), (loss_m, grads_m, shards_m, where_m) = seen
        differ = ([] if torch.equal(loss_s, loss_m) else ["loss"]) + \
            [f"grad {n}" for n in grads_s if not torch.equal(grads_s[n], grads_m[n])] + \
            [f"shard {n}" for n in shards_s if not torch.equal(shards_s[n], shards_m[n])] + \
            [f"placement {n}: {where_m[n]}" for n in where_s if where_s[n] != where_m[n]]
        verdicts.append(differ[:3] or "equal")
    return verdicts


def _hsdp_whole(rank, folder):
    """What torch's utilities see on the 2 x 2 mesh: full_tensor() of the weights and
    gradients, clip_grad_norm_, the state_dict, and a distributed checkpoint of each."""
    models = _hsdp_both("blocks", (2, 2), "fp32")
    for model in models:
        x, y = _hsdp_batch("blocks", 0, 0, rank)
        F.mse_loss(model(x), y).backward()
    seen = []
    for who, model in zip(("stock", "minddp"), models):
        whole = {n: (p.full_tensor(), p.grad.full_tensor()) for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, foreach=False)
        clipped = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        state = {n: (t.placements, t.to_local().clone()) for n, t in model.state_dict().items()}
        dcp.save(model.state_dict(), checkpoint_id=f"{folder}/{who}")
        seen.append((whole, norm.full_tensor(), clipped, state))
    differ = [what for i, what in enumerate(["whole weights and gradients", "norm",
                                             "clipped gradients", "state_dict"])
              if not _same(seen[0][i], seen[1][i])]
    # minddp's checkpoint loaded into stock's model sharded from other weights (dcp.load
    # writes into the DTensors in place): minddp's shards, on every rank.
    torch.manual_seed(1)
    other = nn.Sequential(GPTBlock(), GPTBlock())
    mesh = stock_mesh("cpu", (2, 2), mesh_dim_names=HSDP_NAMES)
    for unit in [*other, other]:
        stock_fully_shard(unit, mesh=mesh)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=f"{folder}/minddp")
    if not _same({n: t.to_local() for n, t in state.items()},
                 {n: p.to_local() for n, p in models[1].state_dict().items()}):
        differ.append("stock loading minddp's checkpoint")
    layouts = [dcp.FileSystemReader(f"{folder}/{who}").read_metadata().state_dict_metadata
               for who in ("stock", "minddp")]
    if layouts[0] != layouts[1]:
        differ.append("the checkpoints' metadata")
    return differ


def _hsdp_fp16(rank):
    """float16 gradients whose sum over 4 ranks passes float16's largest (65504): stock
    divides by 2 before the sum and by 2 after (divide_factors), and stays finite.
    Per mesh: (equal to stock's, stock's all finite, stock's largest |gradient|)."""
    seen = {}
    for shape in ((1, 4), (4, 1)):
        grads = []
        for model in _hsdp_both("mlp-fp16", shape, "fp32"):
            x = _hsdp_batch("mlp", 0, 0, rank)[0].half()
            (model(x).float().sum() * 5000).backward()  # the last bias' gradient: 4 x 5000
            grads.append({n: p.grad.to_local() for n, p in model.named_parameters()})
        stock, ours = grads
        seen[shape] = (all(torch.equal(stock[n], ours[n]) for n in stock),
                       all(bool(g.isfinite().all()) for g in stock.values()),
                       max(float(g.abs().max()) for g in stock.values() if g.numel()))
    return seen


def _same(a, b):
    """a == b, tensors by torch.equal, nested in dicts and tuples."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _hsdp(rank, world_size, folder):
    return {"cases": {case: _hsdp_case(rank, *case) for case in HSDP_CASES},
            "whole": _hsdp_whole(rank, folder), "fp16": _hsdp_fp16(rank)}


HSDP_FOLDER = tempfile.mkdtemp(prefix="minddp-hsdp-")  # the checkpoints: every rank writes
atexit.register(shutil.rmtree, HSDP_FOLDER, True)
share_spawn(_hsdp, [4], HSDP_FOLDER)


@pytest.mark.parametrize("case", HSDP_CASES, ids=lambda c: f"{c[0]}-{c[1][0]}x{c[1][1]}-{c[2]}")
def test_hsdp_on_a_2d_mesh_is_bitwise_stocks(case):
    for rank, out in enumerate(shared_results(_hsdp, 4)):
        assert out["cases"][case] == ["equal"] * 3, f"rank {rank}: {out['cases'][case]}"


def test_hsdp_whole_tensors_clip_and_checkpoint_are_stocks():
    for rank, out in enumerate(shared_results(_hsdp, 4)):
        assert out["whole"] == [], f"rank {rank}: {out['whole']}"


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_hsdp_in_float16_divides_before_and_after_the_sum_as_stock(shape):
    seen = [out["fp16"][shape] for out in shared_results(_hsdp, 4)]
    assert all(equal and finite for equal, finite, _ in seen), seen
    # the case bites: 4 ranks' values of this size, summed in float16, are inf
    assert max(largest for _, _, largest in seen) * 4 > torch.finfo(torch.float16).max, seen


@pytest.mark.parametrize("shape, names, message", [
    ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"),
     "fully_shard on a 3-D mesh: it takes a 1-D mesh (FSDP) or a 2-D one (HSDP)"),
    ((2, 2), None, "fully_shard on a 2-D mesh (HSDP) without mesh_dim_names")])
def test_a_mesh_fully_shard_cannot_take_is_one_line_before_any_collective(shape, names, message):
    # No process group exists here: the refusal comes before anything that would need one.
    mesh = DeviceMesh("cpu", shape, names or ("a", "b"), groups=[None] * len(shape), rank=0)
    if names is None:
        mesh.mesh_dim_names = None  # (stock's init_device_mesh leaves them None if not given)
    with pytest.raises(UsageError) as error:
        fully_shard(nn.Linear(2, 2), mesh=mesh)
    assert error.value.message == message and error.value.same_on_every_rank
