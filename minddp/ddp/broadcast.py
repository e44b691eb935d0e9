"""broadcast_parameters: start every rank from the same weights (rank 0's).

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # ManualDDP calls it at construction

Gradient averaging keeps replicas identical only if they *start* identical: each rank
applies the same averaged gradient, so equal weights stay equal, and unequal weights
stay unequal forever. Seeding every rank the same usually gives equal weights, but
nothing guarantees it (a rank that drew one extra random number, a checkpoint loaded on
one rank only), so stock DDP copies rank 0's state to everyone when it wraps the model.
"""

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError
from ..launch.groups import global_rank


def check_same_model(module, group=None, tensors=None):
    """Raise UsageError, on every rank alike, if ranks hold differently shaped models.

    Collective: call on every rank. `tensors` ((name, tensor) pairs) replaces the module's
    parameters and buffers as what is compared (fsdp/shard.py: one unit's own parameters).

    Broadcasting into a tensor of another shape fails deep in the backend, or pairs the
    wrong tensors and hangs; a list of names and shapes, compared up front, names the
    culprit instead. Stock DDP checks the same (_verify_param_shape_across_processes).
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    if tensors is None:
        tensors = list(module.named_parameters()) + list(module.named_buffers())
    mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]
    everyone = [None] * world_size
    # Every rank gets every list, so every rank reaches the same verdict and raises
    # at the same point: no rank is left waiting in the broadcast below.
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone[1:], start=1):
        for i in range(max(len(everyone[0]), len(theirs))):
            a = everyone[0][i] if i < len(everyone[0]) else ("(none)", (), "")
            b = theirs[i] if i < len(theirs) else ("(none)", (), "")
            if a != b:
                raise UsageError(
                    f"rank {rank}'s model differs from rank 0's at parameter #{i}:"
                    f" rank 0 has {a[0]!r} {list(a[1])} {a[2]},"
                    f" rank {rank} has {b[0]!r} {list(b[1])} {b[2]}",
                    hint="build the same model on every rank (the same code and arguments;"
                         " nothing that depends on the rank)", same_on_every_rank=True)


@torch.no_grad()
def broadcast_parameters(module, src=0, group=None, buffers=True):
    """Overwrite every parameter (and buffer, unless buffers=False) with rank `src`'s, in place.

    Collective: call on every rank. `src` is a rank of `group` (groups.py), as in stock DDP.

    In place matters: the optimizer already holds these very tensors.
    Buffers count too: a BatchNorm's running mean is state the forward pass uses
    (stock DDP leaves them alone only with broadcast_buffers=False).
    """
    if dist.get_world_size(group) == 1:
        return  # nobody to copy from (and mps tensors, which no backend carries, stay put)
    # named_parameters() lists a tied (shared) weight once, so it is sent once.
    tensors = list(module.named_parameters()) + (list(module.named_buffers()) if buffers else [])
    for _, tensor in tensors:
        dist.broadcast(tensor, src=global_rank(group, src), group=group)


@torch.no_grad()
def broadcast_buffers(module, src=0, group=None):
    """Overwrite every buffer with group rank `src`'s, in place (stock's broadcast_buffers=True)."""
    if dist.get_world_size(group) == 1:
        return
    for _, buffer in module.named_buffers():
        dist.broadcast(buffer, src=global_rank(group, src), group=group)
