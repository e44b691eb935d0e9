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
all_reduce in forward, and its mirror image in backward: ops.py's copy_to_ranks before a
column split (its backward sums the input's gradient), sum_over_ranks after a row split.
Attention splits by heads: with q, k and v column-split, each rank holds whole heads, and
the model's `view(B, T, -1, head_dim)` finds heads / world_size of them.

In the order below: the two splits (stock's ColwiseParallel and RowwiseParallel), each
keeping its slice of rank 0's weight (keep_slice), then parallelize_module(model, mesh,
{"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}), stock's API (plan.py
reads the plan). Every rank's weights, gradients and outputs equal stock's bit for bit.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..launch.groups import global_rank
from .ops import (ShareOfBias, copy_to_ranks, gather_sequence, scatter_sequence,
                     sequence_dim, sum_over_ranks)
from .plan import SLICES, check_plan, check_split, refuse_layouts, region_of, resolve_plan


class ColwiseParallel:
    """Cut an nn.Linear's output features over the ranks (stock's name; the output stays cut)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        refuse_layouts("ColwiseParallel", output_layouts=output_layouts, wanted="Shard(-1)",
                       use_local_output=use_local_output)
        # Shard(1): a slice of the sequence comes in (sequence_parallel.py)
        self.sequence_dim = sequence_dim(input_layouts)

    def check(self, name, module, parent, world_size):
        check_split(name, module, parent, 0, world_size)

    def apply(self, name, module, group, src, region=None):
        """region: the PrepareModuleInput whose gathered input feeds this split, if any."""
        keep_slice(module, "weight", 0, group, src)  # the weight's rows
        if module.bias is not None:
            keep_slice(module, "bias", 0, group, src)
        module.register_forward_pre_hook(
            lambda m, args: (self._whole(name, args[0], group, region), *args[1:]))

    def _whole(self, name, x, group, region):
        if self.sequence_dim is not None:
            return gather_sequence(x, self.sequence_dim, group)
        if region is not None and region.gave(name, x):
            # Made from the gathered input (after any ops): its gradient here is this rank's
            # part of a sum, and the gather's backward (a reduce_scatter) sums it once.
            return x
        # The input arrives whole on every rank; its gradient must come back whole too.
        return copy_to_ranks(x, group)


class RowwiseParallel:
    """Cut an nn.Linear's input features over the ranks; one all_reduce makes the output whole."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        refuse_layouts("RowwiseParallel", input_layouts=input_layouts, wanted="Shard(-1)",
                       use_local_output=use_local_output)
        # Shard(1): a reduce_scatter along the sequence (sequence_parallel.py)
        self.sequence_dim = sequence_dim(output_layouts)

    def check(self, name, module, parent, world_size):
        check_split(name, module, parent, 1, world_size)

    def apply(self, name, module, group, src, region=None):
        keep_slice(module, "weight", 1, group, src)  # the weight's columns
        if module.bias is not None and src is not None and dist.get_world_size(group) > 1:
            dist.broadcast(module.bias.data, src=global_rank(group, src), group=group)  # whole
        module.forward = lambda x: self._forward(module, x, group)

    def _forward(self, module, x, group):
        share = None if module.bias is None else ShareOfBias.apply(module.bias,
                                                                    dist.get_world_size(group))
        partial = F.linear(x, module.weight, share)
        if self.sequence_dim is not None:
            return scatter_sequence(partial, self.sequence_dim, group)
        return sum_over_ranks(partial, group)


@torch.no_grad()
def keep_slice(module, attr, dim, group, src):
    """Collective: module.<attr> becomes this rank's equal slice along `dim` of group rank
    src's tensor (src None: of this rank's own), a new Parameter."""
    full = getattr(module, attr)
    world_size = dist.get_world_size(group)
    if src is not None and world_size > 1:  # stock's distribute_tensor: rank src's values
        dist.broadcast(full.data, src=global_rank(group, src), group=group)
    part = full.detach().chunk(world_size, dim)[dist.get_rank(group)].clone()
    setattr(module, attr, nn.Parameter(part, requires_grad=full.requires_grad))
    SLICES.setdefault(module, {})[attr] = (dim, group)


def parallelize_module(module, device_mesh=None, parallelize_plan=None, *, src_data_rank=0):
    """Split the plan's Linear layers over the ranks; returns module. Collective.

    device_mesh: a 1-D DeviceMesh (its group) or None (the default group). As stock's, the
    plan's splits take group rank src_data_rank's weights (None: each rank's own); nothing
    else is touched: a layer outside the plan keeps this rank's weights.
    """
    group = device_mesh.get_group() if device_mesh is not None else None
    plan = resolve_plan(module, parallelize_plan)  # {module name: style}, wildcards expanded
    check_plan(module, plan, group)  # a wrong plan: refused before any collective
    modules = dict(module.named_modules())
    for name, style in plan.items():
        # A column split inside a module whose inputs sequence_parallel.py's PrepareModuleInput
        # gathers may take its input from that gather: the plan says where (region_of); a
        # forward then asks the gather whether this very input was made from it (region.gave).
        style.apply(name, modules[name], group, src_data_rank, region_of(name, plan))
    return module
