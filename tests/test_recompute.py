"""Activation recomputation (minddp/memory/recompute.py) against torch.utils.checkpoint.

    pytest tests/test_recompute.py

The small GPT with dropout on, each block under no checkpointing, minddp's checkpoint_module
and stock's composable checkpoint (torch.distributed._composable.checkpoint, which runs
torch.utils.checkpoint's non-reentrant checkpoint), full and selective (stock's
create_selective_checkpoint_contexts; the matmuls and attention kept), 3 AdamW
steps: every gradient of every step and every weight after `torch.equal` to no
checkpointing's, in one process (fp32, and under CPU autocast to bfloat16) and at 2 ranks
under minddp's fully_shard and stock's, and under minddp's and stock's tensor parallelism;
the ops each policy runs again in backward counted, minddp's equal to stock's. Then the
edges of stock's contract, against torch.utils.checkpoint.checkpoint: keyword arguments, a
tuple's outputs back-propagated one at a time, preserve_rng_state=False (the gradients and
the RNG after), a kept output changed in place (refused by both).
"""

import collections
import functools
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed._composable import checkpoint as stock_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ahead import ahead_run
from helpers import REPO, share_spawn, shared_results
from minddp.bench.transformer import gpt
from minddp.memory.recompute import checkpoint, checkpoint_module

aten = torch.ops.aten
SAVE = [aten.addmm.default, aten.mm.default,  # the matmuls, and attention: kept (selective)
        aten._scaled_dot_product_flash_attention_for_cpu.default]
POLICIES = {"none": None, "full": (), "selective": SAVE}


class CountOps(TorchDispatchMode):
    """How many times each op ran (by name), e.g. during a backward."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket).split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


def stock_checkpoint_module(module, save_ops=()):
    """Stock's composable checkpoint on a module (selective: its context_fn)."""
    context = {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                               list(save_ops))} if save_ops else {}
    return stock_checkpoint(module, **context)


def wrapped(model, impl, policy):
    """model with each block under impl's checkpoint and policy (none: as it is); mixed:
    stock's checkpoint."""
    if POLICIES[policy] is not None:
        apply = checkpoint_module if impl == "minddp" else stock_checkpoint_module
        for block in model[1:-1]:  # embedding, blocks, head: the blocks
            apply(block, POLICIES[policy])
    return model


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def train(model, rank=0, steps=3, autocast=False, batch=4):
    """3 AdamW steps; per step every gradient, then every weight; and each backward's ops."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    torch.manual_seed(7)  # dropout's masks: the same draws for every policy
    grads, ops = [], []
    for _ in range(steps):
        idx, target = (torch.randint(0, 32, (batch, 8), generator=g) for _ in range(2))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        with CountOps() as counting:
            loss.backward()
        ops.append(counting.counts)
        grads.append([local(p.grad).clone() for p in model.parameters()])
        optimizer.step()
    return grads, [local(p).detach().clone() for p in model.parameters()], ops


def verdicts(runs):
    """{run: None if every gradient and weight equals no checkpointing's, else what differs}."""
    reference = runs["minddp", "none"]
    out = {}
    for key, (grads, weights, _) in runs.items():
        bad = [f"step {s} gradient {i}" for s, (ours, ref) in enumerate(zip(grads, reference[0]))
               for i, (a, b) in enumerate(zip(ours, ref)) if not torch.equal(a, b)]
        bad += [f"weight {i}" for i, (a, b) in enumerate(zip(weights, reference[1]))
                if not torch.equal(a, b)]
        out[key] = bad[:3] or None
    return out


def recomputed(runs, key):
    """The ops run again in backward: those beyond no checkpointing's (detach: bookkeeping)."""
    extra = runs[key][2][0] - runs[key[0], "none"][2][0]
    return {op: n for op, n in extra.items() if op != "detach"}


def one_process(autocast=False, seed=0, batch=4):
    runs = {}
    for policy in POLICIES:
        for impl in ("minddp", "stock"):
            torch.manual_seed(seed)
            runs[impl, policy] = train(wrapped(gpt(dropout=0.1), impl, policy),
                                       autocast=autocast, batch=batch)
    return runs


@pytest.mark.parametrize("autocast,seed,batch", [(False, 0, 4), (True, 0, 4), (False, 3, 2)],
                         ids=["fp32", "autocast-bf16", "seed3-batch2"])
def test_recomputation_is_bitwise_no_checkpointing_and_stocks(autocast, seed, batch):
    runs = one_process(autocast, seed, batch)
    assert verdicts(runs) == {key: None for key in runs}
    for policy in ("full", "selective"):
        ours, stocks = recomputed(runs, ("minddp", policy)), recomputed(runs, ("stock", policy))
        assert ours == stocks, (policy, ours, stocks)


def test_full_recomputes_the_matmuls_selective_only_the_cheap_ops():
    runs = one_process()
    full = recomputed(runs, ("minddp", "full"))
    selective = recomputed(runs, ("minddp", "selective"))
    # 2 blocks x 6 Linear layers, attention once per block; the dropout masks drawn again
    # (the RNG put back: the same masks, or the gradients above would differ)
    assert full["addmm"] == 12 and full["_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert full["bernoulli_"] == 4 and full["gelu"] == 2
    assert "addmm" not in selective and "_scaled_dot_product_flash_attention_for_cpu" \
        not in selective
    assert selective["gelu"] == 2 and selective["bernoulli_"] == 4
    # the early stop: each block's last residual add saves nothing, and is not run again
    assert full["add"] == selective["add"] == 2


def _distributed(rank, world_size):
    """At 2 ranks: fully_shard (a unit per checkpointed block, then the model) and tensor
    parallelism (each block's plan, then the checkpoint around it), minddp's and stock's."""
    from minddp.mesh.compose import tp_plan
    from minddp.references.libraries import LIBRARIES
    out = {}
    for how in ("fsdp", "tp"):
        runs = {}
        # "mixed": stock's checkpoint on minddp's parallelism. Stock's TP runs other ops
        # (DTensor's) than minddp's: the ops recomputed compare on one TP, minddp's.
        for policy in POLICIES:
            for impl in ("minddp", "stock", "mixed"):
                lib = LIBRARIES["stock" if impl == "stock" else "manual"]
                mesh = lib.init_device_mesh("cpu", (world_size,))
                torch.manual_seed(0)
                model = gpt(dropout=0.1)
                if how == "tp":
                    for block in model[1:-1]:
                        lib.tp.parallelize_module(block, mesh, tp_plan(lib.tp))
                model = wrapped(model, impl, policy)
                if how == "fsdp":
                    for block in model[1:-1]:
                        lib.fully_shard(block, mesh=mesh)
                    lib.fully_shard(model, mesh=mesh)
                runs[impl, policy] = train(model, rank)
        out[how] = verdicts(runs), {key: recomputed(runs, key) for key in runs
                                    if key[1] != "none"}
    return out


share_spawn(_distributed, [2])


@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_recomputation_under_fsdp_and_tp_is_bitwise(how):
    for rank, out in enumerate(shared_results(_distributed, 2)):
        equal, ops = out[how]
        assert equal == {key: None for key in equal}, (rank, equal)
        for policy in ("full", "selective"):
            assert ops["minddp", policy] == ops["mixed", policy], (rank, policy, ops)
            if how == "fsdp":  # the same ops in both FSDPs' blocks
                assert ops["minddp", policy] == ops["stock", policy], (rank, policy, ops)
            assert ops["minddp", policy]["bernoulli_"] == 4, (rank, policy, ops)


@pytest.mark.parametrize("s,b,h,a", [(16, 2, 32, 4), (64, 3, 64, 8)])
def test_the_bytes_a_block_keeps_are_the_formulas(s, b, h, a):
    # minddp recompute-bench's measurement: the storages alive after a block's forward
    from minddp.bench.recompute import IMPLS, block, formula, kept_bytes
    for policy in POLICIES:
        for impl in IMPLS:
            kept = kept_bytes(block(policy, impl, h, a), s, b, h)
            assert kept == formula(policy, s, b, h, a), (policy, impl, kept)


def test_recompute_bench_runs_and_counts_the_matmuls_run_again(tmp_path):
    from argparse import Namespace
    from minddp.bench.recompute import cost_rows, draw
    args = Namespace(sequence=8, batch=2, width=16, heads=4, blocks=2, rounds=1,
                     png=str(tmp_path / "r.png"))
    extra = {(r["policy"], r["impl"]): r["extra"] for r in cost_rows(args)}
    assert extra == {("none", "minddp"): 0.0, ("full", "minddp"): 1.0, ("full", "stock"): 1.0,
                     ("selective", "minddp"): 0.0, ("selective", "stock"): 0.0}
    draw(args)
    assert (tmp_path / "r.png").stat().st_size > 0


BREAKS = ahead_run([sys.executable, str(REPO / "examples" / "break_recompute.py")])


def test_the_recompute_breaks_show_their_damage():
    # examples/break_recompute.py, one process: new masks in the second forward part the
    # gradients from no checkpointing's at step 0; the input changed in place after the
    # forward is refused in backward by all three (minddp's check: the version counter)
    result = BREAKS.result()
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout.split("--break ")
    assert out[1].count("every gradient equal to no checkpointing's, 3 steps") == 2, out[1]
    assert out[2].count("parts from no checkpointing at step 0") == 2, out[2]
    assert "minddp: refused in backward: checkpoint: input 0 was modified by an inplace" \
           " operation" in out[3], out[3]
    assert out[3].count("refused in backward") == 3, out[3]


# The edges of torch.utils.checkpoint's contract: keyword arguments, a tuple's outputs
# back-propagated one at a time, preserve_rng_state=False, a kept output changed in place.
# Each against stock's function checkpoint (non-reentrant) or no checkpointing, bit for bit.
def stock_fn(function, *args, save_ops=(), **kwargs):
    """torch.utils.checkpoint.checkpoint, non-reentrant (selective: its context_fn)."""
    if save_ops:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 list(save_ops))
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def no_checkpoint(function, *args, save_ops=(), preserve_rng_state=True, **kwargs):
    return function(*args, **kwargs)


IMPLS = {"none": no_checkpoint, "minddp": checkpoint, "stock": stock_fn}


def leaves(seed=0, *shape):
    torch.manual_seed(seed)
    return [torch.randn(*shape, requires_grad=True) for _ in range(2)]


def scaled(x, bias=None, scale=1.0):
    # sin saves its input, x * scale + bias: the second forward must see the same keywords
    return F.dropout((x * scale + bias).sin(), 0.5, training=True).exp()


@pytest.mark.parametrize("save_ops", [(), SAVE], ids=["full", "selective"])
def test_keyword_arguments_reach_the_forward_and_the_second_forward(save_ops):
    grads = {}
    for impl, run_checkpoint in IMPLS.items():
        x, bias = leaves(0, 4, 3)
        torch.manual_seed(1)  # dropout's mask
        run_checkpoint(scaled, x, bias=bias, scale=2.0, save_ops=save_ops).sum().backward()
        grads[impl] = x.grad, bias.grad
    for impl in ("minddp", "stock"):
        assert all(map(torch.equal, grads[impl], grads["none"])), impl


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x, scale=1.0):
        return F.gelu(self.fc(x) * scale)


def test_checkpoint_module_takes_keyword_arguments():
    grads = {}
    for impl, wrap in (("none", lambda m: m), ("minddp", checkpoint_module),
                       ("stock", stock_checkpoint)):
        torch.manual_seed(0)
        module = wrap(Scaled())
        module(torch.randn(4, 3), scale=2.0).sum().backward()
        grads[impl] = [p.grad for p in module.parameters()]
    for impl in ("minddp", "stock"):
        assert all(map(torch.equal, grads[impl], grads["none"])), impl


def two_outputs(x, y):
    a = x.tanh()  # the second output's only, before the shared ops: asked for after them
    h = F.dropout((x * y).sin(), 0.5, training=True)
    return h.cos(), h * a


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_each_output_back_propagated_on_its_own(preserve_rng_state):
    # the second backward through the retained graph runs the forward again, as stock's does
    # (and with preserve_rng_state=False draws its masks anew from the RNG, as stock's does)
    out = {}
    for impl in ("none", "minddp", "stock") if preserve_rng_state else ("minddp", "stock"):
        x, y = leaves(0, 4, 3)
        torch.manual_seed(1)
        first, second = IMPLS[impl](two_outputs, x, y, preserve_rng_state=preserve_rng_state)
        first.sum().backward(retain_graph=True)
        after_first = x.grad.clone(), y.grad.clone()
        second.sum().backward()
        out[impl] = [*after_first, x.grad, y.grad, torch.get_rng_state()]
    for impl in out:
        assert all(map(torch.equal, out[impl], out["stock"])), impl


def test_selective_backs_each_output_on_its_own_where_stock_refuses():
    # stock's selective frees each kept output at its first use and refuses a second
    # backward; minddp's keeps them while the graph lives: no checkpointing's gradients
    grads = {}
    for impl in ("none", "minddp", "stock"):
        x, y = leaves(0, 4, 3)
        torch.manual_seed(1)
        first, second = IMPLS[impl](two_outputs, x, y, save_ops=SAVE + [aten.mul.Tensor])
        first.sum().backward(retain_graph=True)
        if impl == "stock":
            with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
                second.sum().backward()
        else:
            second.sum().backward()
            grads[impl] = x.grad, y.grad
    assert all(map(torch.equal, grads["minddp"], grads["none"]))


def block(h):
    return F.dropout(F.gelu(h), 0.5, training=True).sin()


def two_blocks(x, checkpoint_block, preserve_rng_state):
    for _ in range(2):
        x = checkpoint_block(block, x, preserve_rng_state=preserve_rng_state)
    return x


@pytest.mark.parametrize("save_ops", [(), SAVE], ids=["full", "selective"])
@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_preserve_rng_state_means_what_stocks_means(preserve_rng_state, save_ops):
    # False: no RNG state stashed or put back, so the second forward draws new masks from the
    # RNG as it stands, and leaves it moved on: the gradients and the RNG after are stock's
    out = {}
    for impl in ("none", "minddp", "stock"):
        x, _ = leaves(0, 4, 3)
        torch.manual_seed(1)
        run_checkpoint = functools.partial(IMPLS[impl], save_ops=save_ops)
        two_blocks(x, run_checkpoint, preserve_rng_state).sum().backward()
        out[impl] = x.grad, torch.get_rng_state()
    assert all(map(torch.equal, out["minddp"], out["stock"]))
    # True: the masks of the first forward, so no checkpointing's gradients and RNG after
    assert all(map(torch.equal, out["minddp"], out["none"])) == preserve_rng_state


def added_in_place(x, fc):
    out = fc(x)  # addmm: kept by selective
    out += x  # changes the kept tensor: the second forward would add x twice
    return out.sin()


@pytest.mark.parametrize("impl", ["minddp", "stock"])
def test_a_kept_output_changed_in_place_is_refused(impl):
    torch.manual_seed(0)
    fc, x = torch.nn.Linear(3, 3), torch.randn(4, 3, requires_grad=True)
    out = IMPLS[impl](added_in_place, x, fc, save_ops=SAVE)
    with pytest.raises(RuntimeError, match="Tensor cached during selective activation "
                                           "checkpoint has been mutated"):
        out.sum().backward()
