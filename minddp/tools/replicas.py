"""check_replicas: do all ranks hold the same weights? A collective, bit for bit.

    torchrun --nproc_per_node=2 examples/manual_ddp.py --check-replicas

DDP's whole promise is that replicas never drift apart: same start (the broadcast),
same averaged gradient, same step. When something breaks that (a forgotten broadcast,
a skipped all_reduce, a rank-dependent random draw), nothing fails: each rank trains on
happily, and PyTorch's own debug mode (TORCH_DISTRIBUTED_DEBUG=DETAIL) checks the shapes
of collectives, never the values the ranks hold. This check compares the values.

Cheap first: each rank sends a digest of every parameter and buffer (a hash of its
bytes), so identical replicas cost one small all_gather. Only when a digest differs
are that tensor's values gathered, to say which ranks differ and by how much.
"""

import hashlib

import torch
import torch.distributed as dist

from ..ddp.broadcast import check_same_model
from ..launch.usage_error import UsageError


class ReplicaError(UsageError):
    """Ranks hold different values in the same parameter or buffer."""


def _digest(tensor):
    data = tensor.detach().cpu().contiguous().reshape(-1)  # 0-d tensors too
    return hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def check_replicas(module, group=None):
    """Check that every rank holds the same weights and buffers, bit for bit.

    Collective: call on every rank. Returns quietly when they agree; otherwise every rank
    raises the same ReplicaError: the first differing tensor (by name), which ranks
    disagree with rank 0, and the largest absolute difference.
    """
    module = getattr(module, "module", module)  # a DDP wrapper's model
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    check_same_model(module, group)  # differently shaped models: the clear mismatch error
    # named_parameters() lists a tied weight once; buffers are state too (BatchNorm).
    named = list(module.named_parameters()) + list(module.named_buffers())
    mine = [_digest(t) for _, t in named]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    for i, (name, tensor) in enumerate(named):
        ranks = [r for r in range(1, world_size) if everyone[r][i] != everyone[0][i]]
        if not ranks:
            continue
        # Every rank sees the same digests, so every rank reaches this line for the same
        # tensor and the all_gather below pairs up.
        values = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(values, tensor.detach().contiguous(), group=group)
        gap = max((values[r].double() - values[0].double()).abs().max().item() for r in ranks)
        raise ReplicaError(
            f"replicas differ: {name!r} on rank{'s' if len(ranks) > 1 else ''}"
            f" {', '.join(map(str, ranks))} differs from rank 0's (largest absolute difference"
            f" {gap:.3e})", hint="every rank must start from the same weights (broadcast) and"
            " apply the same averaged gradient (all_reduce, then divide)", same_on_every_rank=True)
