"""Activation recomputation by hand: keep a block's inputs, run its forward again in backward.

    pytest tests/test_recompute.py    # gradients equal to torch.utils.checkpoint's, bit for bit

A forward keeps what its backward needs: each op saves tensors (a Linear its input, a GELU its
input, a dropout its mask), and those stay alive from the forward until the backward. For a
transformer block they dwarf the weights. Recomputation (activation checkpointing) keeps
only the block's inputs and runs the block's forward a second time, in backward, to get the
saved tensors back just before they are needed: memory for compute. In the order below:
  checkpoint   full recomputation, with saved-tensor hooks: in forward each tensor an op
               would save is replaced by its number; the first time a backward asks for one,
               the block runs again (the RNG state put back, so dropout draws the same mask;
               the autocast state put back, so the same ops run in the same precision), its
               saved tensors are collected in the same order, and each number answered
  Keep, Reuse  selective recomputation (save_ops): in forward the outputs of the ops named
               (the matmuls and attention: the costly ones to redo) are kept; in the second
               forward those ops return their kept outputs instead: only the cheap ops
               (pointwise: GELU, dropout, adds) are recomputed
  checkpoint_module   a module's forward under checkpoint, in place (before fully_shard)
Stock's API: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False), or for a
module torch.distributed._composable.checkpoint(module); selective: context_fn=
functools.partial(create_selective_checkpoint_contexts, [ops to save]).
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map


aten = torch.ops.aten
# Selective's default: keep what is costly to compute again, the matmuls and attention (each
# device's kernel of it); recompute the rest: layer norms, GELU, dropout, adds, reshapes.
MATMULS = tuple(getattr(aten, name).default for name in (
    "addmm", "mm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention") if hasattr(aten, name))
POLICIES = {"none": None, "full": (), "selective": MATMULS}  # policy -> save_ops


class _Stop(Exception):
    """Raised inside the second forward once backward has every tensor it asked for."""


def checkpoint(function, *args, save_ops=(), preserve_rng_state=True, **kwargs):
    """function(*args, **kwargs), keeping only its arguments (selective: save_ops' outputs too).

    Gradients bit for bit those of no checkpointing, and of stock's checkpoint(function, *args,
    use_reentrant=False, **kwargs) (save_ops: its selective one, the same ops saved)."""
    device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
    # Autograd refuses a saved tensor changed in place since (its version counter moved);
    # the kept arguments are saved by hand, so they are checked by hand.
    arguments = {**dict(enumerate(args)), **kwargs}  # by position, then by name
    versions = {name: a._version for name, a in arguments.items() if torch.is_tensor(a)}
    # Put back what makes the second forward the first one again: the random state (dropout
    # draws from it) and autocast (which decides each op's precision). preserve_rng_state=
    # False (stock's flag, stock's meaning) stashes none: new masks are drawn (a break-it).
    rng = torch.get_rng_state() if preserve_rng_state else None
    cuda_rng = torch.cuda.get_rng_state() if device == "cuda" and preserve_rng_state else None
    autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    count, answers, kept, answered = [0], {}, [], [None]  # answered: for which backward

    def pack(tensor):  # forward: instead of the tensor, its number in the order saved
        count[0] += 1
        return count[0] - 1

    def unpack(number):  # backward: the first ask of each backward runs the forward again
        # Once per backward (autograd's graph task), as stock's: a second backward through a
        # retained graph (each output of a tuple on its own) asks for tensors the first used.
        task = torch._C._current_graph_task_id()
        if task != answered[0]:
            answers.clear()  # what the previous backward did not ask for: not reused
            recompute()
            answered[0] = task
        return answers.pop(number)  # each asked once: freed as soon as it is used

    def recompute():
        changed = [name for name, v in versions.items() if arguments[name]._version != v]
        if changed:
            raise RuntimeError(f"checkpoint: input {changed[0]!r} was modified by an inplace "
                               "operation after the forward: the second forward would differ")
        saved = []

        def collect(tensor):
            # detached, as stock's: the second forward's graph is only a means, and a kept
            # tensor's grad_fn would keep that graph alive (a TP op's with its process group)
            saved.append(tensor.detach())
            if len(saved) == count[0]:
                raise _Stop  # as stock's early stop: the ops after the last saved one are not rerun
            return None  # never unpacked: the outer graph asks `answers`

        # The inputs again, cut from the outer graph: the second forward builds a graph of
        # its own, only to harvest its saved tensors; the outer graph's nodes use them.
        inputs, keywords = [_cut(a) for a in args], {k: _cut(a) for k, a in kwargs.items()}
        cuda = [torch.cuda.current_device()] if cuda_rng is not None else []
        # after it, the RNG as before (False: moved on by the new draws, as stock's)
        with torch.random.fork_rng(devices=cuda, enabled=preserve_rng_state):
            if rng is not None:
                torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
            try:
                with torch.enable_grad(), torch.autocast(device, dtype=autocast[1],
                                                         enabled=autocast[0]), \
                        torch.autograd.graph.saved_tensors_hooks(collect, lambda _: None), \
                        Reuse(kept, save_ops) if save_ops else contextlib.nullcontext():
                    function(*inputs, **keywords)
            except _Stop:
                pass
        if len(saved) != count[0]:
            raise RuntimeError(f"the second forward saved {len(saved)} tensors, the first"
                               f" {count[0]}: the function must run the same ops each time")
        answers.update(enumerate(saved))

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
            Keep(kept, save_ops) if save_ops else contextlib.nullcontext():
        return function(*args, **kwargs)


def _cut(a):
    return a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a


def _versions(out):  # the version counter of each tensor in an op's output
    return [t._version for t in tree_leaves(out) if torch.is_tensor(t)]


def _detached(out):
    # A detached tensor shares the output's memory, and its version counter too, but only
    # with ADInplaceOrView on: a dispatch mode runs below it, without (stock's _detach_helper).
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tree_map(lambda o: o.detach() if torch.is_tensor(o) else o, out)


class Keep(TorchDispatchMode):
    """Forward, selective: keep the outputs of the ops in save_ops, in the order they ran.
    A dispatch mode sees every op below autograd, so autograd still records each op."""

    def __init__(self, kept, save_ops):
        super().__init__()
        self.kept, self.save_ops = kept, set(save_ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.save_ops:
            # detached: kept as values; the second forward hands them to the next op. With
            # their versions now: the function may still change the output in place (out += x)
            kept = _detached(out)
            self.kept.append((kept, _versions(kept)))
        return out


class Reuse(TorchDispatchMode):
    """The second forward, selective: an op in save_ops returns its kept output instead of
    running again (autograd above still records it and saves its inputs, as the first
    time); every other op is recomputed."""

    def __init__(self, kept, save_ops):
        super().__init__()
        self.kept, self.save_ops = list(kept), set(save_ops)  # a copy: a second backward reuses

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.save_ops:
            out, versions = self.kept.pop(0)
            if _versions(out) != versions:  # the kept value is not the op's: stock's words
                raise RuntimeError("Tensor cached during selective activation checkpoint has "
                                   "been mutated (out += x?); hint: write out = out + x")
            return out
        return func(*args, **(kwargs or {}))


def checkpoint_module(module, save_ops=(), preserve_rng_state=True):
    """Run `module`'s forward under checkpoint from now on, in place (as stock's composable
    torch.distributed._composable.checkpoint): its parameters keep their names, and
    fully_shard or a TP plan applied to it wraps the checkpointed forward. Returns module."""
    forward = module.forward  # the forward as it is now (a TP plan's, if one was applied)
    module.forward = lambda *args, **kwargs: checkpoint(
        forward, *args, save_ops=save_ops, preserve_rng_state=preserve_rng_state, **kwargs)
    return module
