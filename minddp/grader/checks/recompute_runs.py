"""Recomputation's runs: the models and cases, and one forward and backward recorded.

    minddp grade exercises/recompute.py       # checks/recompute.py grades these runs

Three small models (a residual MLP, one with in-place ops, a transformer block), full and
selective, with dropout and without, under autocast, preserve_rng_state=False: one run
records the loss, every gradient (the input's first), the random state after backward, the
bytes the forward left alive for backward and the matmuls run again. Stock's runs and the
plain ones (no checkpoint) are kept for the next file graded in the same process.
"""

import functools
import gc

import torch
import torch.nn.functional as F
# Stock's references, imported before any process group exists (as zero.py's).
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as stock_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ...bench.recompute import Outputs as _Outputs  # what the forward leaves alive, measured


class _MLP(torch.nn.Module):
    """A residual MLP: up, GELU, dropout, down, plus the input."""

    def __init__(self, dropout):
        super().__init__()
        self.up, self.down, self.p = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), dropout

    def forward(self, x):
        return x + self.down(F.dropout(F.gelu(self.up(x)), self.p, training=True))


class _InPlace(_MLP):
    """The MLP with in-place ops: GELU's output shifted in place, dropout in place."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        h.add_(0.5)
        F.dropout(h, self.p, training=True, inplace=True)
        return self.down(h).sin()


def _block(dropout):
    from ...bench.transformer import Block
    return Block(16, 4, dropout=dropout)


MODELS = {"a residual MLP": (_MLP, (6, 8)), "an MLP with in-place ops": (_InPlace, (6, 8)),
          "a transformer block (attention, LayerNorms)": (_block, (2, 8, 16))}


def _recompute_cases():
    cases = [dict(model=m, policy=p, dropout=d, autocast=False, preserve=True)
             for m in MODELS for p in ("full", "selective") for d in (0.0, 0.5)]
    block = "a transformer block (attention, LayerNorms)"
    cases += [dict(model=block, policy=p, dropout=0.5, autocast=True, preserve=True)
              for p in ("full", "selective")]
    cases += [dict(model="a residual MLP", policy=p, dropout=0.5, autocast=False, preserve=False)
              for p in ("full", "selective")]
    return cases


def _case_label(case):
    return (f"{case['model']}, {case['policy']}" + (f", dropout {case['dropout']}" if
                                                     case["dropout"] else ", no dropout")
            + (", under autocast to bfloat16" if case["autocast"] else "")
            + (", preserve_rng_state=False" if not case["preserve"] else ""))


class _Count(TorchDispatchMode):
    """How many of save_ops' ops run meanwhile (in backward: run again)."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.n = set(ops), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.ops
        return func(*args, **(kwargs or {}))


def _run(case, how, save_ops, frozen):
    """One forward and backward: the loss, the gradients (the input's first), the random
    state after, and the bytes the forward left alive for backward. frozen: whether this
    process has set objects aside from the collector already (gc.get_freeze_count() > 0)."""
    # Everything made before this run is set aside from the collector, so gc.collect() below
    # reads this run's objects only (a full collection in a process with torch imported takes
    # 0.1-0.2 s). Safe here because the model and input are built inside the run: a module
    # built before a freeze could hold a cycle the collector no longer frees. A warm rank's
    # imports are set aside already (run/frozen.py), and an unfreeze would bring them back.
    if frozen:
        return _run_one(case, how, save_ops)
    gc.freeze()
    try:
        return _run_one(case, how, save_ops)
    finally:
        gc.unfreeze()


def _run_one(case, how, save_ops):
    build, shape = MODELS[case["model"]]
    torch.manual_seed(0)
    model = build(case["dropout"])
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saving = save_ops if case["policy"] == "selective" else ()
    if how == "stock":
        context = {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                   list(saving))} if saving else {}
        run = functools.partial(stock_checkpoint, model, use_reentrant=False,
                                preserve_rng_state=case["preserve"], **context)
    elif how == "none":
        run = model
    else:
        run = functools.partial(how, model, save_ops=saving, preserve_rng_state=case["preserve"])
    torch.manual_seed(2)  # dropout's masks
    with _Outputs() as outputs, torch.autocast("cpu", dtype=torch.bfloat16,
                                               enabled=case["autocast"]):
        y = run(x)
    gc.collect()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr(), 0}
    alive = {}
    for t in (ref() for ref in outputs.made):
        if t is not None and t.untyped_storage().data_ptr() not in skip:
            alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    torch.rand(3)  # a draw between forward and backward (the next block's dropout, say)
    loss = y.float().square().mean()
    with _Count(save_ops) as counted:
        loss.backward()
    grads = {"(the input's gradient)": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
    return {"(the loss)": loss.detach(), **{n: None if g is None else g.detach().clone()
                                            for n, g in grads.items()},
            "rng": torch.get_rng_state(), "kept": sum(alive.values()), "again": counted.n}


_REFERENCES = {}  # stock's runs and the plain ones: one process grades many files (the tests:
# every planted mistake on one set of ranks), each case's run once per state below


def _reference(case, how, save_ops, frozen):
    """_run(case, how, save_ops, frozen) for how = "stock" or "none", kept for the next file
    graded here while the process-wide state a student's code could leave changed is the same."""
    try:
        key = (tuple(case.items()), how, tuple(save_ops), _state())
        hash(key)
    except TypeError:  # (a student's save_ops that cannot be a key: run every time)
        return _run(case, how, save_ops, frozen)
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(case, how, save_ops, frozen)
    return _REFERENCES[key]


def _state():
    """What a checkpoint could leave set and a run would read: autocast, grad mode, the
    default dtype, determinism, threads, modes and saved-tensors hooks still pushed."""
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
            torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(False) is None)
