"""Stock DDP's whole contract, knob by knob: ManualDDP against stock DDP with the same setting.

    pytest tests/test_contract.py

Each configuration trains the same model wrapped twice (stock DDP and ManualDDP, same
arguments), on each rank its own batches, and compares bit for bit on every rank:
every gradient (and whether it is None) after every step, the state_dict (buffers
included) at the end, and the eval-mode output. Steps include the first iteration (one
bucket) and the rebuilt buckets after it.
"""

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import share_spawn, shared_results
from minddp import ManualDDP, UsageError
from minddp.dropin.comm_hooks import fp16_mean_hook


class BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                          torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def forward(self, x, step=0, rank=0):
        return self.layers(x)


class Wide(torch.nn.Module):
    """Several buckets at bucket_cap_mb=0.05: 5 Linear layers of 64x64 (16 KB each)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64 if i else 4, 64) for i in range(5)],
                                          torch.nn.Linear(64, 3))

    def forward(self, x, step=0, rank=0):
        return self.layers(x)


class Branchy(torch.nn.Module):
    """Which head runs depends on the step and the rank: unused parameters, varying."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 16)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 3) for _ in range(3))

    def forward(self, x, step=0, rank=0):
        # step 0: head 0 everywhere; then rank-dependent; head 2 only on rank 1 at step 2
        head = 0 if step == 0 else (step + rank) % 2 if not (step == 2 and rank == 1) else 2
        return self.heads[head](torch.relu(self.body(x)))


class AuxHead(torch.nn.Module):
    """Returns (logits, aux): the aux head is in forward's output but not always in the loss."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 16)
        self.head, self.aux = torch.nn.Linear(16, 3), torch.nn.Linear(16, 2)

    def forward(self, x, step=0, rank=0):
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)


def _loss(output, y, step, rank):
    if not isinstance(output, tuple):
        return F.cross_entropy(output, y)
    # AuxHead: the aux output joins the loss on some steps and ranks only; on the others
    # its parameters are reached by forward's output but get no gradient (stock: None)
    logits, aux = output
    return F.cross_entropy(logits, y) + (aux.square().mean() if (step + rank) % 3 == 0 else 0)


CONFIGS = {  # name: (model class, wrapper kwargs, zero_grad set_to_none, no_sync micro-batch)
    "buffers": (BatchNormNet, {}, True, False),
    "buffers-off": (BatchNormNet, {"broadcast_buffers": False}, True, False),
    "bucket-view": (Wide, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.05}, True, False),
    "bucket-view-zeroed": (Wide, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.05}, False, True),
    "unused": (Branchy, {"find_unused_parameters": True}, True, False),
    "unused-zeroed": (Branchy, {"find_unused_parameters": True}, False, False),
    "unused-by-the-loss": (AuxHead, {"find_unused_parameters": True}, True, False),
    "unused-by-the-loss-zeroed": (AuxHead, {"find_unused_parameters": True}, False, True),
    "allreduce-hook": (Wide, {"bucket_cap_mb": 0.05}, True, False),
    "fp16-hook": (Wide, {"bucket_cap_mb": 0.05}, True, False),
    "minddp-hook": (Wide, {"bucket_cap_mb": 0.05}, True, False),
    # Arguments that steer only stock's C++ machinery: accepted, the numbers are stock's.
    "stock-only-knobs": (BatchNormNet, {"check_reduction": True, "dim": 0, "init_sync": True},
                         True, False),
    "forward-sync-off": (BatchNormNet, {"forward_sync_buffers": False}, True, False),
    # The buckets rebuilt a step later than without the flag: other bits from the second step
    "static-graph": (Wide, {"static_graph": True, "bucket_cap_mb": 0.05}, True, False),
    "static-graph-no-sync": (Wide, {"static_graph": True, "bucket_cap_mb": 0.05}, False, True),
    "static-graph-bucket-view": (Wide, {"static_graph": True, "bucket_cap_mb": 0.05,
                                        "gradient_as_bucket_view": True}, True, False),
}
HOOKS = {  # name: (stock's hook, ManualDDP's hook)
    "allreduce-hook": (default_hooks.allreduce_hook,) * 2,
    "fp16-hook": (default_hooks.fp16_compress_hook,) * 2,
    # minddp's teaching hook on ManualDDP against PyTorch's fp16 hook on stock DDP
    "minddp-hook": (default_hooks.fp16_compress_hook, fp16_mean_hook),
}
STEPS = 4
# Stock DDP's arguments on this torch: 2.11 and 2.12 lack forward_sync_buffers (2.13's, which
# ManualDDP follows), so that one configuration has no stock to be compared with there.
STOCK_TAKES = set(inspect.signature(DDP.__init__).parameters)


def _train(model, rank, set_to_none, micro_batch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        optimizer.zero_grad(set_to_none=set_to_none)
        if micro_batch and step == 2:
            with model.no_sync():  # half the batch stays local, the other half syncs both
                _loss(model(x[:3], step, rank), y[:3], step, rank).backward()
            x, y = x[3:], y[3:]
        _loss(model(x, step, rank), y, step, rank).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.module.parameters()])
        optimizer.step()
    model.eval()
    with torch.no_grad():
        out = model(torch.linspace(-1, 1, 24).reshape(6, 4))
    out = out[0] if isinstance(out, tuple) else out
    return grads, copy.deepcopy(model.module.state_dict()), out


def _compare(name, stock, manual):
    (gs, ss, os_), (gm, sm, om) = stock, manual
    for step, (a, b) in enumerate(zip(gs, gm)):
        for i, (x, y) in enumerate(zip(a, b)):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return f"{name}: step {step} parameter #{i} differs ({x is None}, {y is None})"
    for key in ss:
        if not torch.equal(ss[key], sm[key]):
            return f"{name}: state_dict[{key!r}] differs"
    return None if torch.equal(os_, om) else f"{name}: eval output differs"


def _all_configs(rank, world_size):
    problems, outputs, views, without_stock = [], {}, {}, []
    for name, (cls, kwargs, set_to_none, micro_batch) in CONFIGS.items():
        torch.manual_seed(rank)  # different weights per rank: both must broadcast rank 0's
        base = cls()
        results = []
        wrappers = (DDP, ManualDDP) if set(kwargs) <= STOCK_TAKES else (ManualDDP,)
        if len(wrappers) == 1:
            without_stock.append(name)
        for wrapper in wrappers:
            model = wrapper(copy.deepcopy(base), **kwargs)
            if name in HOOKS:
                model.register_comm_hook(None, HOOKS[name][wrapper is ManualDDP])
            results.append(_train(model, rank, set_to_none, micro_batch))
            if wrapper is ManualDDP and kwargs.get("gradient_as_bucket_view") and set_to_none is False:
                flats = [b.flat for b in model.buckets]
                views[name] = all(any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                                      for f in flats) for p in model.module.parameters())
        problem = _compare(name, *results) if len(results) == 2 else None
        if problem:
            problems.append(problem)
        outputs[name] = results[-1][2]
    return problems, outputs, views, without_stock


share_spawn(_all_configs, [1, 2, 3, 4])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_knob_bitwise_equal_to_stock(world_size):
    results = shared_results(_all_configs, world_size)
    for problems, _, views, without_stock in results:
        assert problems == []
        assert views == {"bucket-view-zeroed": True}  # .grad lives in the buckets
        # every configuration compared with stock, but 2.13's argument on an older stock
        assert without_stock == ([] if torch.__version__ >= "2.13" else ["forward-sync-off"])
    # Replicas agree with each other too: eval outputs equal on every rank, buffers included.
    for name in CONFIGS:
        if name not in ("buffers-off", "forward-sync-off") or world_size == 1:
            assert all(torch.equal(r[1][name], results[0][1][name]) for r in results), name
    if world_size > 1:  # without the broadcast each rank keeps its own running statistics
        assert not all(torch.equal(r[1]["buffers-off"], results[0][1]["buffers-off"]) for r in results)


def _bad_hooks(rank, world_size):
    messages = {}

    def returns_a_tensor(state, bucket):
        return bucket.buffer()

    def returns_half(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer()[: bucket.buffer().numel() // 2])
        return future

    for hook in (returns_a_tensor, returns_half):
        model = ManualDDP(torch.nn.Linear(4, 3))
        model.register_comm_hook(None, hook)
        try:
            model(torch.ones(2, 4)).sum().backward()
        except UsageError as err:
            messages[hook.__name__] = str(err)
    model = ManualDDP(torch.nn.Linear(4, 3))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except UsageError as err:
        messages["twice"] = str(err)
    model = ManualDDP(torch.nn.Linear(4, 3))
    model(torch.ones(2, 4)).sum().backward()
    try:  # stock 2.13 accepts this silently (its docs: "register before calling backward")
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except UsageError as err:
        messages["late"] = str(err)
    # bf16: stock refuses it on a CPU build (no CUDA, no NCCL); ManualDDP runs it on gloo.
    try:
        DDP(torch.nn.Linear(4, 3)).register_comm_hook(None, default_hooks.bf16_compress_hook)
    except Exception as err:
        messages["stock-bf16"] = str(err)
    torch.manual_seed(0)
    model = ManualDDP(torch.nn.Linear(4, 3))
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    own = torch.autograd.grad(model.module(x).sum(), model.module.weight)[0]
    return messages, model.module.weight.grad, own


def test_comm_hook_mistakes_are_clear_errors_and_bf16_runs_where_stock_refuses():
    results = shared_results(_bad_hooks, 2)
    for messages, _, _ in results:
        assert messages["returns_a_tensor"].startswith(
            "comm hook _bad_hooks.<locals>.returns_a_tensor returned Tensor, not a torch.futures.Future")
        assert messages["returns_half"].startswith(
            "comm hook _bad_hooks.<locals>.returns_half must give a tensor of bucket 0's 15 elements,"
            " it gave a tensor of 7 elements")
        assert messages["twice"].startswith("register_comm_hook can only be called once")
        assert messages["late"].startswith("register_comm_hook after training started")
        if torch.version.cuda is None:  # a CPU build: stock refuses (its check reads the build)
            assert messages["stock-bf16"].startswith(
                "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+")
        else:  # a CUDA build, with or without a GPU: stock takes the hook
            assert "stock-bf16" not in messages, messages["stock-bf16"]
    # bf16 on gloo: the average of the two ranks' gradients, to bfloat16's 8 bits.
    mean = (results[0][2] + results[1][2]) / 2
    for _, grad, _ in results:
        assert torch.allclose(grad, mean, rtol=2 ** -7, atol=1e-6)
        assert torch.equal(grad, results[0][1])


share_spawn(_bad_hooks, [2])  # (in the spawn the FSDP, TP and PP tests share)
