"""PyTorch's FSDP2 example, run with stock's fully_shard and with minddp's import swapped.

    pytest tests/test_fsdp_example.py

Shaped like `distributed/FSDP2` in pytorch/examples (written here, at CPU sizes): a small
transformer built on the meta device, fully_shard per block then the root, `isinstance(model,
FSDPModule)` and the shards' placements inspected, explicit prefetching, to_empty() and
reset_parameters(), mixed precision checked with unshard()/reshard(), AdamW, clip_grad_norm_,
then a distributed checkpoint (torch.distributed.checkpoint) saved, and training resumed from
it, and from the one stock wrote. Every number is compared with `torch.equal`: the losses and
clipped norms per step, each rank's shards, the whole weights, the optimizer state and the
checkpoint's files. Besides: units inside activation checkpoints (early stop on and off,
reentrant and not), gradient accumulation without sync, and the refusals. One spawn per world
size runs every case; each is a test of its own.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as StockPolicy
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import minddp
from helpers import share_spawn, shared_results, usage_errors

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 16, 4, 3, 8, 4
IMPLS = {"stock": (stock_fully_shard, StockPolicy),
         "minddp": (minddp.fully_shard, minddp.MixedPrecisionPolicy)}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention = Attention()
        self.feed_forward = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                          nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, checkpointing=None):
        super().__init__()
        self.checkpointing = checkpointing  # None, or use_reentrant for each block
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            if self.checkpointing is None:
                h = layer(h)
            else:
                h = checkpoint(layer, h, use_reentrant=self.checkpointing)
        return self.output(self.norm(h)).float()


def _init(model):
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _build(impl, mixed_precision=False, prefetch=False, checkpointing=None, meta=True):
    """The example's setup: meta model, fully_shard per block and the root, prefetching."""
    shard, policy = IMPLS[impl]
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Transformer(checkpointing)
    kwargs = {"mp_policy": policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              } if mixed_precision else {}
    for layer in model.layers:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    inspected = (isinstance(model, FSDPModule) and isinstance(model, Transformer)
                 and all(p.placements == (Shard(0),) and p.dtype == torch.float32
                         for p in model.parameters()))
    if prefetch:  # as the example: each block gathers the next two (forward), previous two
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
            layer.set_modules_to_backward_prefetch(layers[max(i - 2, 0):i][::-1])
    return model, inspected


def _materialize(model):
    model.to_empty(device="cpu")
    _init(model)


def _steps(model, optimizer, steps, first=0, explicit_unshard=False):
    """The example's loop; per step the loss and the clipped norm (as floats: bit-exact)."""
    seen = []
    for step in range(first, first + steps):
        if explicit_unshard:
            model.unshard()
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(x).sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        seen.append((loss.item(), norm.full_tensor().item() if isinstance(norm, DTensor)
                     else norm.item()))
    return seen


def _snapshot(model, optimizer):
    """Each rank's shards and optimizer state (local), and the whole weights."""
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    whole = {n: p.full_tensor() for n, p in model.named_parameters()}
    state = {f"{n}.{k}": (v.to_local() if isinstance(v, DTensor) else v).clone()
             for n, p in model.named_parameters()
             for k, v in optimizer.state[p].items()}
    return local, whole, state


def _save(model, optimizer, path):
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def _resume(impl, path, mixed_precision, prefetch):
    """The example's resume: a fresh meta model, sharded, its state loaded from `path`."""
    model, _ = _build(impl, mixed_precision, prefetch)
    model.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return model, optimizer


def _layout(path):
    """What a checkpoint's .metadata says of each tensor: shape, dtype, each rank's chunk."""
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def _example(rank, world_size, folder, mixed_precision, prefetch):
    """The whole example under both imports; the verdicts, one per thing compared."""
    runs, verdict = {}, {}
    for impl in IMPLS:
        model, inspected = _build(impl, mixed_precision, prefetch)
        _materialize(model)
        if mixed_precision:  # the example's inspect_mixed_precision
            model.unshard()
            inspected &= all(p.dtype == torch.bfloat16 for p in model.parameters(recurse=False))
            model.reshard()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        seen = _steps(model, optimizer, 3, explicit_unshard=prefetch)
        path = os.path.join(folder, f"{impl}-{mixed_precision}-{prefetch}")
        _save(model, optimizer, path)
        runs[impl] = (inspected, seen, _snapshot(model, optimizer), path)
        # Resumed from its own checkpoint: 2 steps more.
        model, optimizer = _resume(impl, path, mixed_precision, prefetch)
        runs[impl] += (_steps(model, optimizer, 2, first=3), _snapshot(model, optimizer))
    stock, ours = runs["stock"], runs["minddp"]
    verdict["isinstance FSDPModule, Shard(0), fp32 (bf16 unsharded)"] = ours[0] and stock[0]
    verdict["losses and clipped norms"] = ours[1] == stock[1]
    for i, what in enumerate(["shards", "whole weights", "optimizer state"]):
        verdict[what] = _equal(ours[2][i], stock[2][i])
    dist.barrier()
    files = sorted(p.name for p in Path(stock[3]).iterdir())
    verdict["checkpoint files"] = files == sorted(p.name for p in Path(ours[3]).iterdir()) and \
        all((Path(stock[3]) / f).read_bytes() == (Path(ours[3]) / f).read_bytes()
            for f in files if f != ".metadata") and \
        _layout(stock[3]) == _layout(ours[3])
    verdict["resumed: losses and norms"] = ours[4] == stock[4]
    verdict["resumed: shards, weights, state"] = all(_equal(ours[5][i], stock[5][i])
                                                     for i in range(3))
    # minddp resumed from the checkpoint stock wrote: the same as from its own.
    model, optimizer = _resume("minddp", stock[3], mixed_precision, prefetch)
    same = _steps(model, optimizer, 2, first=3) == stock[4]
    verdict["minddp resumed from stock's checkpoint"] = same and all(
        _equal(a, b) for a, b in zip(_snapshot(model, optimizer), stock[5]))
    return verdict


def _checkpointed(rank, world_size, use_reentrant, early_stop):
    """Units inside torch.utils.checkpoint: 2 steps, shards and losses against stock's."""
    out = {}
    with set_checkpoint_early_stop(early_stop):
        for impl in IMPLS:
            model, _ = _build(impl, checkpointing=use_reentrant)
            _materialize(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            out[impl] = (_steps(model, optimizer, 2), _snapshot(model, optimizer)[0])
    return out["stock"][0] == out["minddp"][0] and _equal(out["stock"][1], out["minddp"][1])


def _no_sync(rank, world_size, mixed_precision):
    """Two microbatches, the first without gradient sync; shards against stock's."""
    out = {}
    for impl in IMPLS:
        model, _ = _build(impl, mixed_precision)
        _materialize(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        for step in range(2):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                model(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        out[impl] = _snapshot(model, optimizer)
    return all(_equal(a, b) for a, b in zip(out["stock"], out["minddp"]))


def _refusals(rank, world_size):
    model, _ = _build("minddp", meta=False)
    return usage_errors([
            ("set_custom_all_gather", lambda: model.set_custom_all_gather(None)),
            ("set_gradient_divide_factor", lambda: model.set_gradient_divide_factor(2.0)),
            ("_get_fsdp_state", lambda: model._get_fsdp_state()),
            ("shard_placement_fn", lambda: minddp.fully_shard(nn.Linear(2, 2),
                                                              shard_placement_fn=lambda p: None)),
            ("deepcopy", lambda: __import__("copy").deepcopy(model)),
            ("prefetch a plain module", lambda: model.set_modules_to_forward_prefetch(
                [nn.Linear(2, 2)]))])


EXAMPLES = [(False, False), (True, False), (False, True), (True, True)]
CHECKPOINTING = [(False, True), (False, False), (True, True), (True, False)]


def _caught(fn, *args):
    """fn's verdict, or the error it raised (one case failing must not hide the others)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (reported by the test, named)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _everything(rank, world_size, folder):
    out = {"example": {case: _caught(_example, rank, world_size, folder, *case)
                       for case in EXAMPLES if world_size == 2 or case == (True, True)},
           "checkpointing": {case: _caught(_checkpointed, rank, world_size, *case)
                             for case in CHECKPOINTING},
           "no_sync": {mp: _caught(_no_sync, rank, world_size, mp) for mp in (False, True)}}
    if world_size == 2:
        out["refusals"] = _refusals(rank, world_size)
    return out


FOLDER = tempfile.mkdtemp(prefix="minddp-fsdp-example-")  # the checkpoints: every rank writes
atexit.register(shutil.rmtree, FOLDER, True)
share_spawn(_everything, [2, 3], FOLDER)


def _results(world_size):
    return shared_results(_everything, world_size)


def _example_id(case):
    return f"{'bf16' if case[0] else 'fp32'}-{'prefetch' if case[1] else 'no_prefetch'}"


@pytest.mark.parametrize("world_size,case", [(2, case) for case in EXAMPLES] + [(3, (True, True))],
                         ids=lambda v: _example_id(v) if isinstance(v, tuple) else str(v))
def test_pytorch_fsdp2_example_with_the_import_swapped(world_size, case):
    for rank, out in enumerate(_results(world_size)):
        assert isinstance(out["example"][case], dict), f"rank {rank}: {out['example'][case]}"
        differ = [what for what, same in out["example"][case].items() if not same]
        assert not differ, f"rank {rank}: not equal to stock: {differ}"


@pytest.mark.parametrize("case", CHECKPOINTING,
                         ids=lambda c: f"{'reentrant' if c[0] else 'non_reentrant'}-"
                                       f"{'early_stop' if c[1] else 'no_early_stop'}")
@pytest.mark.parametrize("world_size", [2, 3])
def test_units_inside_activation_checkpoints_equal_stock(world_size, case):
    for rank, out in enumerate(_results(world_size)):
        assert out["checkpointing"][case] is True, f"rank {rank}: {out['checkpointing'][case]}"


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_without_sync_equals_stock(world_size, mixed_precision):
    for rank, out in enumerate(_results(world_size)):
        assert out["no_sync"][mixed_precision] is True, f"rank {rank}: {out['no_sync'][mixed_precision]}"


@pytest.mark.parametrize("what,message", [
    ("set_custom_all_gather", "FSDPModule.set_custom_all_gather is not implemented"),
    ("set_gradient_divide_factor", "FSDPModule.set_gradient_divide_factor is not implemented"),
    ("_get_fsdp_state", "stock FSDP's internal state (_get_fsdp_state) does not exist here"),
    ("shard_placement_fn", "fully_shard(shard_placement_fn=...) is not implemented in minddp"),
    ("deepcopy", "cannot be deep-copied"),
    ("prefetch a plain module", "got a Linear that minddp's fully_shard did not shard")])
def test_what_minddp_lacks_is_refused_in_one_line(what, message):
    for out in _results(2):
        assert out["refusals"][what] is not None and message in out["refusals"][what], \
            out["refusals"][what]
