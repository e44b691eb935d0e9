"""ZeRO-1's state dict (optimizer.py): the shards' optimizer state as one optimizer's, and back.

    pytest tests/test_zero.py -k state        # consolidate and resume, bit for bit

Each rank's optimizer holds state for its own shard, numbered 0, 1, ... in the shard's order.
A checkpoint wants what a plain optimizer over all the parameters would save: state keyed by
each parameter's place in the whole list. Saving gathers every rank's state on one rank and
renumbers it (consolidated); loading keeps this rank's parameters' entries and numbers them
as its shard does (this_ranks_part). PyTorch's ZeroRedundancyOptimizer does the same.
"""

import torch.distributed as dist

from ..launch.groups import global_rank


def consolidated(optimizer, to):
    """Collective: on group rank `to`, the full state dict of a ShardedOptimizer; None elsewhere."""
    gathered = [None] * optimizer.world_size if optimizer.rank == to else None
    dst = global_rank(optimizer.process_group, to)  # dst= takes a global rank
    dist.gather_object(optimizer.optim.state_dict(), gathered, dst=dst,
                       group=optimizer.process_group)
    if optimizer.rank != to:
        return None
    groups = optimizer.param_groups
    index = {p: i for i, p in enumerate(p for g in groups for p in g["params"])}
    state = {}
    for rank, local in enumerate(gathered):
        local_params = [p for group in optimizer.partition[rank] for p in group["params"]]
        for local_index, value in local["state"].items():
            state[index[local_params[local_index]]] = value
    return {"state": dict(sorted(state.items())),
            "param_groups": [{**_settings(g), "params": [index[p] for p in g["params"]]}
                             for g in groups]}


def this_ranks_part(optimizer, state_dict):
    """The state dict for this rank's optimizer from a full one; the settings go to every group."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        group.update(_settings(saved))
    local_params = [p for g in optimizer.optim.param_groups for p in g["params"]]
    local_index = {p: i for i, p in enumerate(local_params)}
    state = {local_index[params[i]]: value for i, value in state_dict["state"].items()
             if params[i] in local_index}
    return {"state": state,
            "param_groups": [{**_settings(g), "params": [local_index[p] for p in g["params"]]}
                             for g in optimizer.optim.param_groups]}


def _settings(group):
    """A param group's settings (lr, betas, ...): everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}
