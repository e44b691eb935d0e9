"""Tensor parallelism by hand (Megatron): every rank holds a slice of each layer, not a copy.

    torchrun --nproc_per_node=2 examples/tp.py --grad-table runs/tp.txt
    torchrun --nproc_per_node=2 examples/tp.py --tp stock --grad-table runs/tp-stock.txt
    minddp diff runs/tp.txt runs/tp-stock.txt          # IDENTICAL
    pytest tests/test_tp.py                             # every rank bitwise equal to stock's

Data parallelism copies the model and splits the batch. Tensor parallelism splits the layers:
every rank sees the whole batch and holds a slice of each weight. Two splits of a Linear,
y = x W^T + b, pair up:
  column   W's rows (output features) cut over the ranks: from the whole input each rank
           computes its slice of the output; no communication in forward;
  row      W's columns (input features) cut the same way: each rank multiplies its slice of
           the input, and one all_reduce sums the partial outputs into the whole output.
Column then row (an MLP's two layers, attention's q/k/v then its output projection) costs one
all_reduce in forward, and its mirror image in backward. Two operators carry them (Megatron's
f and g), each an autograd Function whose backward is the other's forward:
  copy_to_ranks   forward: identity     backward: all_reduce  (before a column split: each
                  rank's input gradient holds only its slice's part)
  sum_over_ranks  forward: all_reduce   backward: identity    (after a row split)
Attention splits by heads: with q, k and v column-split, each rank holds whole heads, and the
model's `view(B, T, -1, head_dim)` finds heads / world_size of them.

The API is stock's: `parallelize_module(model, mesh, {"mlp.up": ColwiseParallel(),
"mlp.down": RowwiseParallel()})`; every rank's weights, gradients and outputs equal
`torch.distributed.tensor.parallel`'s bit for bit (tests/test_tp.py).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import UsageError
from .sp import gather_sequence, scatter_sequence, _shard_dim


class _CopyToRanks(torch.autograd.Function):
    """f: the whole input goes on as it is; backward sums the ranks' input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # (autograd may hand the same tensor elsewhere: reduce a copy)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """g: the partial outputs summed over ranks; the gradient of a sum reaches each part whole."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ShareOfBias(torch.autograd.Function):
    """The bias of a row split, divided by world_size: each rank adds its share before the sum.

    Why not add the whole bias after the all_reduce, as the textbook does? Stock does this
    (a replicated tensor added to partial sums is split evenly among them, DTensor's rule),
    and the two round differently (examples/break_tp.py --break bias-after). The gradient
    is the whole bias's, on every rank: the division is bookkeeping, not arithmetic to undo.
    """

    @staticmethod
    def forward(ctx, bias, world_size):
        return bias / world_size

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_ranks(x, group=None):
    return _CopyToRanks.apply(x, group)


def sum_over_ranks(x, group=None):
    return _SumOverRanks.apply(x, group)


class ColwiseParallel:
    """Cut an nn.Linear's output features over the ranks (stock's name; the output stays cut)."""

    def __init__(self, *, input_layouts=None):
        self.sequence_dim = _shard_dim(input_layouts)  # Shard(1): a sequence slice (sp.py)

    def apply(self, name, module, group):
        _keep_slice(name, module, "weight", 0, group)  # the weight's rows
        if module.bias is not None:
            _keep_slice(name, module, "bias", 0, group)
        module.register_forward_pre_hook(lambda m, args: (self._whole(args[0], group), *args[1:]))

    def _whole(self, x, group):
        if self.sequence_dim is not None:
            return gather_sequence(x, self.sequence_dim, group)
        if getattr(x, "_whole_on_every_rank", False):
            return x  # gathered already (sp.py): the gather's backward sums the ranks' parts
        # The input arrives whole on every rank; its gradient must come back whole too.
        return copy_to_ranks(x, group)


class RowwiseParallel:
    """Cut an nn.Linear's input features over the ranks; one all_reduce makes the output whole."""

    def __init__(self, *, output_layouts=None):
        self.sequence_dim = _shard_dim(output_layouts)  # Shard(1): a reduce_scatter (sp.py)

    def apply(self, name, module, group):
        _keep_slice(name, module, "weight", 1, group)  # the weight's columns; the bias whole
        module.forward = lambda x: self._forward(module, x, group)

    def _forward(self, module, x, group):
        share = None if module.bias is None else _ShareOfBias.apply(module.bias,
                                                                    dist.get_world_size(group))
        partial = F.linear(x, module.weight, share)
        if self.sequence_dim is not None:
            return scatter_sequence(partial, self.sequence_dim, group)
        return sum_over_ranks(partial, group)


def _keep_slice(name, module, attr, dim, group):
    """Replace module.<attr> by this rank's equal slice along `dim` (a new Parameter)."""
    if not isinstance(module, nn.Linear):
        raise UsageError(f"{name!r} is a {type(module).__name__}, not an nn.Linear",
                         hint="name Linear layers in the plan", same_on_every_rank=True)
    full, world_size = getattr(module, attr), dist.get_world_size(group)
    if full.shape[dim] % world_size:
        raise UsageError(f"{name!r}: {attr} dimension {dim} has {full.shape[dim]} entries,"
                         f" which {world_size} ranks cannot share equally",
                         hint="choose a size the world size divides", same_on_every_rank=True)
    part = full.detach().chunk(world_size, dim)[dist.get_rank(group)].clone()
    part = nn.Parameter(part, requires_grad=full.requires_grad)
    part._tp_split = (dim, group)  # how the slices make the whole (gradient tables gather it)
    setattr(module, attr, part)


def parallelize_module(module, device_mesh=None, parallelize_plan=None):
    """Split the plan's Linear layers over the ranks; returns module. Collective.

    device_mesh: a 1-D DeviceMesh (its group) or None (the default group). The weights
    start from rank 0's, as stock's do, then each rank keeps its slice.
    """
    group = device_mesh.get_group() if device_mesh is not None else None
    modules = dict(module.named_modules())
    if hasattr(module, "require_backward_grad_sync") or any(  # DDP's flag; FSDP's units
            hasattr(m, "_fsdp_unit") for m in modules.values()):
        raise UsageError("parallelize_module on a model already wrapped for data parallelism"
                         " (DDP or fully_shard)", same_on_every_rank=True,
                         hint="split the plain model: tp.py takes one group of ranks, no 2-D mesh")
    for name, style in (parallelize_plan or {}).items():  # a wrong plan: refused before any
        if name not in modules:                             # collective
            raise UsageError(f"the plan names {name!r}, which {type(module).__name__} does"
                             f" not have", same_on_every_rank=True,
                             hint="use the names of model.named_modules()")
        heads = getattr(modules[name.rpartition(".")[0]], "head_dim", None)  # attention's
        width = getattr(modules[name], "out_features", 0) // dist.get_world_size(group)
        if isinstance(style, ColwiseParallel) and heads and width % heads:
            raise UsageError(f"{name!r}: {width} output features per rank is not a whole number"
                             f" of heads of {heads}", same_on_every_rank=True,
                             hint="use a world size that divides the number of heads")
    if dist.get_world_size(group) > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)
    for name, style in (parallelize_plan or {}).items():
        style.apply(name, modules[name], group)
    return module
