"""Whole tensors from a sharded model: a state_dict to save, one to load, gradients to compare.

    torchrun --nproc_per_node=2 examples/fsdp.py --grad-table runs/fsdp.txt   # full_gradients

fsdp.py (and minddp.fully_shard on top of it) keeps each parameter as this rank's block of
rows. Saving a checkpoint that any world size can load, or comparing gradients with DDP's,
needs the whole tensors: one all_gather per parameter puts the blocks back together (and
drops the padding rows); loading cuts each whole tensor into the same blocks again.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


@torch.no_grad()
def full_state_dict(module):
    """The state_dict with every shard gathered into its whole parameter (as before sharding).

    Collective: call on every rank. Every rank gets the whole dict; save it on rank 0.
    """
    return {name: _gather(unit, p, p.shard) if p else t
            for name, t, unit, p in _entries(module)}


@torch.no_grad()
def load_full_state_dict(module, state_dict):
    """Load a whole state_dict (full_state_dict's, or the unsharded model's): each rank keeps
    its rows of every sharded parameter."""
    local = {}
    for name, t, unit, p in _entries(module):
        value = state_dict[name]
        if p:
            start = min(unit.rank * p.rows, value.shape[0])
            value = value[start:start + p.rows]
        local[name] = value
    module.load_state_dict(local)


@torch.no_grad()
def full_gradients(module):
    """{name: whole gradient} for every parameter (gradient tables compare these).

    Collective: call on every rank. None for a parameter without a gradient (a sharded one
    that requires grad but got none on some rank: NaN, its whole shape).
    """
    return {name: _gather(unit, p, p.shard.grad if p.shard.grad is not None
                          else torch.full_like(p.shard, float("nan")))
            if p and p.shard.requires_grad else (None if p else t.grad)
            for name, t, unit, p in _entries(module, params_only=True)}


def _entries(module, params_only=False):
    """(name, tensor, unit, _Param or None) for module's state_dict entries, shards resharded."""
    shards = {}
    for unit in [m._fsdp_unit for m in module.modules() if hasattr(m, "_fsdp_unit")]:
        unit.reshard()  # a unit kept unsharded (the root, after forward) shows its shards again
        shards.update({id(p.shard): (unit, p) for p in unit.params})
    if params_only:
        items = module.named_parameters(remove_duplicate=False)
    else:
        items = module.state_dict(keep_vars=True).items()
    return [(name, t, *shards.get(id(t), (None, None))) for name, t in items]


def _gather(unit, p, shard):
    """All-gather one parameter's blocks (or its gradient's) into the whole tensor."""
    shard = shard.detach()
    block = F.pad(shard.reshape(len(shard), -1), (0, 0, 0, p.rows - len(shard)))  # zero rows
    whole = block.new_empty(unit.world_size * p.rows, *shard.shape[1:])
    if unit.world_size > 1:
        dist.all_gather_single(whole, block.view(p.rows, *shard.shape[1:]), group=unit.group)
    else:
        whole.view(-1).copy_(block.view(-1))
    return whole[:p.full.shape[0]]
