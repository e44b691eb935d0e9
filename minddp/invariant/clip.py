"""Gradient clipping whose norm is one order's: each weight's whole gradient, then the weights.

    pytest tests/test_invariant.py -k clip      # the same norm and scale on every mesh

mesh/clip.py adds each rank's part of the squared norm (its dp rows, its tp slice, its
stage's weights), so the sum's order follows the mesh. Here the norm of every weight is
taken of its whole gradient, the same tensor on every mesh: after the tree's sum over dp
(shards.py) each dp rank holds it whole already; a tp slice is gathered whole (a
concatenation, exact). Then the weights' norms, in the whole model's order, gathered over
pp (each stage has its own weights' norms), are one vector whose norm is the total: torch's
clip_grad_norm_ on one process computes it the same way. The price: every rank computes the
norm of every whole weight of its stage, after an all_gather over tp.
"""

import torch
import torch.distributed as dist

from ..tp.plan import SLICES


def _whole_over_tp(stage, name, grad):
    module_name, _, attr = name.rpartition(".")
    dim, group = SLICES.get(stage.get_submodule(module_name), {}).get(attr, (None, None))
    if dim is None:
        return grad  # not split: every tp rank holds the whole
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return torch.cat(parts, dim)


@torch.no_grad()
def clip_grad_norm_(stage, whole, order, max_norm, pp_group=None):
    """Collective over the mesh: scale every gradient of `stage` so that the whole model's
    norm is at most max_norm; returns that norm (before scaling), the same on every rank.
    whole: {name: gradient whole over dp} (ShardGradients.reduce); order: every weight's
    name in the whole model, in its order."""
    norms = {name: torch.linalg.vector_norm(_whole_over_tp(stage, name, grad))
             for name, grad in whole.items()}
    if pp_group is not None:  # each stage's norms, on every stage
        stages = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, norms, group=pp_group)
        norms = {name: norm for held in stages for name, norm in held.items()}
    total = torch.linalg.vector_norm(torch.stack([norms[name] for name in order]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grad_norm_'s
    for p in stage.parameters():
        if p.grad is not None:  # (a float: fully_shard's gradients are DTensors)
            p.grad.mul_(scale.item())
    return total
