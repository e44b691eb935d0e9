"""Process groups: some of the ranks, collectives among themselves, and a rank's two numbers.

    pytest tests/test_groups.py       # every lesson on new_group([2, 3]) of 4 ranks, vs stock

Every lesson takes a `group` (stock's `process_group=`, or a mesh's): the ranks that run its
collectives. `dist.new_group([2, 3])` makes one of global ranks 2 and 3; inside it, they are
group ranks 0 and 1. So a rank has two numbers, and torch's arguments take either:
    group rank    0 .. size-1 inside the group: what "rank 0's weights" means to DDP on it
                  (dist.get_rank(group)); stock DDP broadcasts from group rank 0
    global rank   0 .. WORLD_SIZE-1: what `src=` and `dst=` of dist.broadcast, send, recv
                  and gather take, whatever group is passed beside them
`dist.broadcast(t, src=0, group=new_group([2, 3]))` names global rank 0, who is not in the
group: torch raises "Global rank 0 is not part of group". Every lesson asks this file instead:
the global rank of a group's rank r, the group's members, and whether this rank is one.
(Later lessons make many groups at once, a grid of them: the mesh.)
"""

import torch.distributed as dist

# Torch 2.13's names for the gather and reduce-scatter into one tensor, which the FSDP and
# tensor-parallel lessons call; 2.11 and 2.12 have the same functions under their older
# names only (2.13 keeps those too, with a FutureWarning).
if not hasattr(dist, "all_gather_single"):
    dist.all_gather_single = dist.all_gather_into_tensor
if not hasattr(dist, "reduce_scatter_single"):
    dist.reduce_scatter_single = dist.reduce_scatter_tensor


def global_rank(group, group_rank):
    """The global rank of `group`'s rank `group_rank` (what src= and dst= take)."""
    if group is None or group is dist.group.WORLD:
        return group_rank  # the whole world: the two numberings coincide
    return dist.get_global_rank(group, group_rank)


def members(group=None):
    """The global ranks in `group`, in the order of their group ranks."""
    return [global_rank(group, r) for r in range(dist.get_world_size(group))]


def is_member(group=None):
    """Is this process in `group`? (new_group hands the others a placeholder, not a group.)"""
    return group is None or dist.get_rank(group) >= 0
