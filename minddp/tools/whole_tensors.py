"""Whole tensors from a sharded model: a state_dict to save, one to load, gradients to compare.

    torchrun --nproc_per_node=2 examples/fsdp.py --grad-table runs/fsdp.txt   # full_gradients

fsdp/shard.py (and minddp.fully_shard on top of it), like stock's fully_shard, keeps each parameter
as this rank's block of rows inside a DTensor that knows the whole shape. Saving a checkpoint
any world size can load, or comparing gradients with DDP's, needs the whole tensors:
`full_tensor()` all_gathers the blocks (and drops the padding rows); loading cuts each whole
tensor into the same blocks again (`distribute_tensor`, each rank from its own copy). For
checkpoints in PyTorch's own format, torch.distributed.checkpoint works on these models as on
stock's (docs/fsdp.md).
"""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..fsdp.param import unit_of


def _reshard_all(module):
    # A unit kept unsharded (the root, after forward) shows its shards again.
    for m in module.modules():
        if unit_of(m) is not None:
            unit_of(m).reshard()


@torch.no_grad()
def full_state_dict(module):
    """The state_dict with every shard gathered into its whole parameter (as before sharding).

    Collective: call on every rank. Every rank gets the whole dict; save it on rank 0.
    """
    _reshard_all(module)
    return {name: t.full_tensor() if isinstance(t, DTensor) else t
            for name, t in module.state_dict().items()}


@torch.no_grad()
def load_full_state_dict(module, state_dict):
    """Load a whole state_dict (full_state_dict's, or the unsharded model's): each rank keeps
    its rows of every sharded parameter."""
    _reshard_all(module)
    local = {}
    for name, t in module.state_dict().items():
        value = state_dict[name]
        if isinstance(t, DTensor):  # src_data_rank=None: from this rank's copy, no collective
            value = distribute_tensor(value.to(t.device), t.device_mesh, t.placements,
                                      src_data_rank=None)
        local[name] = value
    module.load_state_dict(local)


@torch.no_grad()
def full_gradients(module):
    """{name: whole gradient} for every parameter (gradient tables compare these).

    Collective: call on every rank. None for a parameter without a gradient (a sharded one
    that requires grad but got none on some rank: NaN, its whole shape).
    """
    _reshard_all(module)
    whole = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if not isinstance(p, DTensor):
            whole[name] = p.grad
        elif p.requires_grad:  # every rank gathers, a missing gradient as NaN: no rank waits
            whole[name] = (p.grad if p.grad is not None
                           else torch.full_like(p, float("nan"))).full_tensor()
    return whole
