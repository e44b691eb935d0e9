"""Sequence parallelism: what tensor parallelism leaves whole, cut along the sequence instead.

    pytest tests/test_tp.py              # the block with sequence parallel, bitwise vs stock

Read parallel.py first (and ops.py, whose gather and scatter along the sequence this file
uses). Between a row split and the next column split, tensor parallelism keeps the
activations whole on every rank: the LayerNorms, dropouts and residual adds there run
world_size times on the same numbers, and every rank stores them all. Sequence parallelism
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models") gives
each rank a slice of the sequence there instead, and trades the split's collectives:
  row split, then    reduce_scatter along the sequence (not all_reduce): each rank gets the
                     summed output of its own tokens only;
  column split, before  all_gather along the sequence: the whole sequence again;
  LayerNorm          on this rank's tokens; its weights stay whole on every rank, and their
                     gradient, computed from this rank's tokens only, is summed over ranks.
An all_reduce is a reduce_scatter and an all_gather, so the bytes sent are the same; what
changes is the memory between the splits: 1 / world_size of it.

Stock's names: SequenceParallel() on a LayerNorm, PrepareModuleInput(input_layouts=Shard(1),
desired_input_layouts=Replicate()) on a module whose inputs must be whole, and
RowwiseParallel(output_layouts=Shard(1)) (parallel.py).
"""

import weakref

import torch
import torch.distributed as dist

from .ops import COLLECTIVES, gather_sequence, sequence_dim
from .plan import refuse_prepare
from ..launch.usage_error import UsageError


class SequenceParallel:
    """A LayerNorm on this rank's tokens; its weights' gradients summed over ranks."""

    def __init__(self, *, sequence_dim=1, use_local_output=False):
        self.sequence_dim = sequence_dim  # stock's arguments; the output is this rank's slice

    def check(self, name, module, parent, world_size):
        pass  # any module: its weights stay whole on every rank

    def apply(self, name, module, group, src, region=None):
        # Stock leaves the weights as they are on each rank (no broadcast: a LayerNorm starts
        # at ones and zeros everywhere), and so does this.
        hooked = []  # weak references to the tensors that have the hook: each gets it once
        module.register_forward_pre_hook(lambda m, args: _sum_gradients(m, group, hooked))


# Wrappers that move the sum over tp where stock's move it (dropin/sp_order.py):
# module -> make_hook(param, group), used in place of _LocalSum below.
SUM_HOOKS = weakref.WeakKeyDictionary()


def _sum_gradients(module, group, hooked):
    # The hook goes on the tensors the module holds *at forward time*: a wrapper applied
    # after this one (fully_shard) swaps in parameters of its own, and a hook on the replaced
    # tensor would never fire.
    hooked[:] = [ref for ref in hooked if ref() is not None]
    for param in module.parameters():
        if param.requires_grad and not any(ref() is param for ref in hooked):
            hooked.append(weakref.ref(param))
            make_hook = SUM_HOOKS.get(module, _LocalSum)
            param.register_hook(make_hook(param, group))


def summed(grad, group):
    """Collective over tp: a copy of grad, summed over the group's ranks."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class _LocalSum:
    """This rank's own gradient of one weight, its microbatches added, then summed over tp.

    Stock keeps this gradient Partial (a DTensor): each rank adds its microbatches' parts,
    and the sum over tp happens once, when the gradient is read (by the optimizer, or by
    fully_shard before it reduces over dp). Adding per-microbatch sums instead rounds
    otherwise. So each backward adds this rank's part to its own running sum and sets .grad
    to that sum summed over tp: the gradient stock reads, whenever it is read."""

    def __init__(self, param, group):
        self.param, self.group = weakref.ref(param), group
        self.local = self.given = None  # this rank's sum so far; the .grad it became

    def __call__(self, grad):
        param = self.param()
        if param.grad is None or self.given is None or not torch.equal(param.grad, self.given):
            self.local = grad.clone()  # a new step: zero_grad() emptied .grad (or zeroed it)
        else:
            self.local = self.local + grad  # another microbatch, as stock's Partial adds it
        self.given = summed(self.local, self.group)
        param.grad = None  # autograd then stores the whole sum as .grad, not added to the old
        return self.given


class PrepareModuleInput:
    """Gather the module's inputs along the sequence: the modules inside need them whole.

    The column splits inside then take a gathered input (parallel.py): its gradient comes back
    as each rank's part of a sum, which the gather's backward sums once. An input made
    from something else is whole on every rank, and the split sums its gradient itself."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output=False):
        layouts = input_layouts if isinstance(input_layouts, (tuple, list)) else (input_layouts,)
        self.dims = [sequence_dim(layout) for layout in layouts]  # None: passed on as it is
        refuse_prepare(layouts, desired_input_layouts, input_kwarg_layouts, use_local_output)
        self.gathered = []  # this forward's gathered inputs (their autograd nodes)

    def check(self, name, module, parent, world_size):
        pass  # any module: only its inputs change

    def apply(self, name, module, group, src, region=None):
        module.register_forward_pre_hook(lambda m, args: self._gather(args, group))
        module.register_forward_hook(lambda m, args, out: self.gathered.clear())

    def _gather(self, args, group):
        out = tuple(x if d is None else gather_sequence(x, d, group)
                    for x, d in zip(args, self.dims + [None] * len(args)))
        self.gathered = [y.grad_fn for y, d in zip(out, self.dims) if d is not None]
        return out

    def gave(self, name, x):
        """Is x made from this forward's gathered inputs (True), or from other tensors (False)?"""
        sources = autograd_sources(x, [n for n in self.gathered if n is not None])
        if sources == {"gathered", "other"}:  # stock's DTensor refuses the mix too
            raise UsageError(f"{name!r}: its input mixes the gathered input with other tensors"
                             " that need a gradient", same_on_every_rank=True,
                             hint="stock refuses it as well: got mixed torch.Tensor and DTensor")
        return sources == {"gathered"}


def autograd_sources(x, nodes):
    """Where x's gradient flows: into `nodes` ("gathered"), elsewhere ("other"), or both.

    A walk of x's autograd graph back to the nodes; a leaf, or a node made before the oldest
    of them (autograd numbers nodes in the order they are made), is another source."""
    if x.grad_fn is None or not nodes:
        return {"other"} if x.requires_grad else set()
    oldest = min(n._sequence_nr() for n in nodes)
    found, seen, stack = set(), set(), [x.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if any(fn is n for n in nodes):
            found.add("gathered")
        elif (not fn.next_functions or fn._sequence_nr() < oldest
              or getattr(fn, "_forward_cls", None) in COLLECTIVES):
            # A leaf (AccumulateGrad), a node from before the gather, or a tensor that a
            # collective made whole or cut again since (a row split's sum, another gather).
            found.add("other")
        else:
            stack.extend(f for f, _ in fn.next_functions)
    return found
