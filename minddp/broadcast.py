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


@torch.no_grad()
def broadcast_parameters(module, src=0, group=None):
    """Overwrite every parameter and buffer with rank `src`'s, in place.

    In place matters: the optimizer already holds these very tensors.
    Buffers count too: a BatchNorm's running mean is state the forward pass uses.
    """
    if dist.get_world_size(group) == 1:
        return  # nobody to copy from (and mps tensors, which no backend carries, stay put)
    # named_parameters() lists a tied (shared) weight once, so it is sent once.
    for _, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        dist.broadcast(tensor, src=src, group=group)
