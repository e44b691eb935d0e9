"""Activation recomputation by hand: keep a block's inputs, run its forward again in backward.

    pytest tests/test_recompute.py    # gradients equal to torch.utils.checkpoint's, bit for bit

A forward keeps what its backward needs: each op saves tensors (a Linear its input, a GELU its
input, a dropout its mask), and those stay alive from the forward until the backward. For a
transformer block they dwarf the weights. Recomputation (activation checkpointing) keeps
only the block's inputs and runs the block's forward a second time, in backward, to get the
saved tensors back just before they are needed: memory for compute. In the order below:
  checkpoint   full recomputation, with saved-tensor hooks: in forward each tensor an op
               would save is replaced by its number; the first time backward asks for one,
               the block runs again (the RNG state put back, so dropout draws the same mask;
               the autocast state put back, so the same ops run in the same precision), its
               saved tensors are collected in the same order, and each number answered
  Keep, Reuse  selective recomputation (save_ops): in forward the outputs of the ops named
               (the matmuls and attention: the costly ones to redo) are kept; in the second
               forward those ops return their kept outputs instead: only the cheap ops
               (pointwise: GELU, dropout, adds) are recomputed
  checkpoint_module   a module's forward under checkpoint, in place (a block, before
               fully_shard shards it)
Stock's API: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False), or for a
module torch.distributed._composable.checkpoint(module); selective: context_fn=
functools.partial(create_selective_checkpoint_contexts, [ops to save]).
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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


def checkpoint(function, *args, save_ops=(), preserve_rng_state=True):
    """function(*args), keeping only args (and, selective, the outputs of save_ops) for backward.

    The same values as function(*args): the gradients are bit for bit those of no
    checkpointing, and of torch.utils.checkpoint.checkpoint(function, *args,
    use_reentrant=False) (with save_ops: its selective checkpointing, the same ops saved)."""
    device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
    # Autograd refuses a saved tensor changed in place since (its version counter moved);
    # the kept inputs are saved by hand, so they are checked by hand.
    versions = [a._version if torch.is_tensor(a) else None for a in args]
    # Put back what makes the second forward the first one again: the random state (dropout
    # draws from it) and autocast (which decides each op's precision).
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state() if device == "cuda" else None
    autocast = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    count, answers, kept = [0], {}, []

    def pack(tensor):  # forward: instead of the tensor, its number in the order saved
        count[0] += 1
        return count[0] - 1

    def unpack(number):  # backward: the first ask runs the forward again
        if not answers:
            recompute()
        return answers.pop(number)  # each asked once: freed as soon as it is used

    def recompute():
        changed = [i for i, (a, v) in enumerate(zip(args, versions)) if v is not None and
                   a._version != v]
        if changed:
            raise RuntimeError(f"checkpoint: input {changed[0]} was modified by an inplace"
                               " operation after the forward: the second forward would not"
                               " be the first")
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
        inputs = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
                  for a in args]
        cuda = [torch.cuda.current_device()] if cuda_rng is not None else []
        with torch.random.fork_rng(devices=cuda):  # the RNG after the second forward: untouched
            if preserve_rng_state:  # (stock's flag: False draws new masks, a break-it)
                torch.set_rng_state(rng)
            if cuda_rng is not None and preserve_rng_state:
                torch.cuda.set_rng_state(cuda_rng)
            try:
                with torch.enable_grad(), torch.autocast(device, dtype=autocast[1],
                                                         enabled=autocast[0]), \
                        torch.autograd.graph.saved_tensors_hooks(collect, lambda _: None), \
                        Reuse(kept, save_ops) if save_ops else contextlib.nullcontext():
                    function(*inputs)
            except _Stop:
                pass
        if len(saved) != count[0]:
            raise RuntimeError(f"the second forward saved {len(saved)} tensors, the first"
                               f" {count[0]}: the function must run the same ops each time")
        answers.update(enumerate(saved))

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
            Keep(kept, save_ops) if save_ops else contextlib.nullcontext():
        return function(*args)


class Keep(TorchDispatchMode):
    """Forward, selective: keep the outputs of the ops in save_ops, in the order they ran.
    A dispatch mode sees every op below autograd, so autograd still records each op."""

    def __init__(self, kept, save_ops):
        super().__init__()
        self.kept, self.save_ops = kept, set(save_ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.save_ops:
            # detached: kept as values; the second forward hands them to the next op
            self.kept.append(out.detach() if torch.is_tensor(out) else
                             tuple(o.detach() if torch.is_tensor(o) else o for o in out))
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
            return self.kept.pop(0)
        return func(*args, **(kwargs or {}))


def checkpoint_module(module, save_ops=(), preserve_rng_state=True):
    """Run `module`'s forward under checkpoint from now on, in place (as stock's composable
    torch.distributed._composable.checkpoint): its parameters keep their names, and
    fully_shard or a TP plan applied to it wraps the checkpointed forward. Returns module."""
    forward = module.forward  # the forward as it is now (a TP plan's, if one was applied)
    module.forward = lambda *args: checkpoint(forward, *args, save_ops=save_ops,
                                              preserve_rng_state=preserve_rng_state)
    return module
