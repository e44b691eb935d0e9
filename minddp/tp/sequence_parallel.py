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
                     gradient, computed from this rank's tokens only, is a partial sum:
                     summed over ranks when it is read (a DTensor, Partial, as stock's).
An all_reduce is a reduce_scatter and an all_gather, so the bytes sent are the same; what
changes is the memory between the splits: 1 / world_size of it.

Stock's names: SequenceParallel() on a LayerNorm, PrepareModuleInput(input_layouts=Shard(1),
desired_input_layouts=Replicate()) on a module whose inputs must be whole, and
RowwiseParallel(output_layouts=Shard(1)) (parallel.py).
"""

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate

from .ops import COLLECTIVES, gather_sequence, sequence_dim
from .plan import refuse_prepare
from ..launch.usage_error import UsageError

# module -> {name: its weight as a DTensor}: the weights SequenceParallel made, for a wrapper
# that takes them over (dropin/sp_order.py: DDP and fully_shard sum where stock's sum).
WEIGHTS = weakref.WeakKeyDictionary()


class SequenceParallel:
    """A LayerNorm on this rank's tokens; its weights' gradients a partial sum until read."""

    def __init__(self, *, sequence_dim=1, use_local_output=False):
        self.sequence_dim = sequence_dim  # stock's arguments; the output is this rank's slice

    def check(self, name, module, parent, world_size):
        inside = [n for n, _ in module.named_parameters() if "." in n]
        if inside:
            # Stock's register_parameter("sub.weight") raises there (a KeyError): a weight of
            # a module inside would run whole on this rank's tokens, its gradient never summed.
            raise UsageError(f"SequenceParallel on {name!r}: its submodules hold {inside[0]}",
                             hint="put SequenceParallel on each norm itself, as stock needs",
                             same_on_every_rank=True)

    def apply(self, name, module, group, src, region=None):
        # Stock leaves the weights' values as they are on each rank (no broadcast: a LayerNorm
        # starts at ones and zeros everywhere), and so does this. Each becomes a DTensor,
        # Replicate over tp, as stock's: the type that can hold a gradient not yet summed.
        WEIGHTS[module] = {}
        for attr, param in list(module.named_parameters()):
            mesh = DeviceMesh.from_group(group or dist.group.WORLD, param.device.type)
            whole = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            WEIGHTS[module][attr] = torch.nn.Parameter(whole, param.requires_grad)
            module.register_parameter(attr, WEIGHTS[module][attr])
        swapped = {}
        module.register_forward_pre_hook(lambda m, args: _local_weights(m, swapped))
        module.register_forward_hook(lambda m, args, out: m._parameters.update(swapped))


def _local_weights(module, swapped):
    """While the module runs, each weight's local tensor sits in its place: the LayerNorm
    computes on plain tensors, this rank's tokens with the whole weights."""
    swapped.clear()
    for attr, param in module._parameters.items():
        if param is not WEIGHTS.get(module, {}).get(attr):
            continue  # a wrapper took the weight over (dropin/sp_order.py)
        swapped[attr] = param
        # Why Partial: this rank's gradient of a weight sums its own tokens only, a part of
        # the whole. Stock keeps it so, a DTensor whose sum over tp is made when it is read:
        # by the optimizer, by clip_grad_norm_. Until then it is added to as it is (each
        # microbatch's part). An optimizer that adds to the gradient first (SGD's or Adam's
        # weight_decay, Nesterov's momentum) adds a share to each part, then sums: summing
        # here, at each backward, would round otherwise (tests/test_mesh.py).
        module._parameters[attr] = param.to_local(grad_placements=(Partial(),))


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
