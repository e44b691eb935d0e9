"""Gradient clipping on a mesh: one norm of the whole model's gradient, each part counted once.

    torchrun --nproc_per_node=8 examples/gpt_nd.py --mesh pp=2,dp=2,tp=2 --untied --clip 0.5
    pytest tests/test_capstone.py

clip_grad_norm_ scales every gradient by max_norm / (norm of all of them) where that norm
is over one number per model: on a mesh no rank holds all the pieces. A rank's gradient of
a weight is, along each dimension, one of two things:
  a part     fully_shard's dp (HSDP: dp_shard) block, TP's tp slice, a pipeline stage's own
             weights: the squares of the parts add up (over that group) to the whole's;
  a copy     DDP's replica over dp, HSDP's over dp_replicate, a weight TP leaves whole (a
             LayerNorm, a row split's bias) over tp: the same on every rank, counted once.
So each weight's norm is made whole dimension by dimension (x^2, all_reduce, sqrt), the
weights' norms are joined, and the stages' totals are summed over pp last.

Stock's torch.nn.utils.clip_grad_norm_ cannot do this for FSDP over TP: its gradients sit
on two meshes (the TP'd weights' (dp, tp), the others' dp) and it stops at "All operands in
aten.stack.default must have the same mesh"; and it knows nothing of pipeline stages.
torchtitan's clip_grad_norm_ takes the norm per mesh (full_tensor() of each), joins them
(sum of squares, then sqrt) and all_reduces over pp: references/libraries.py writes that out
for stock's calls, and this file computes the same numbers by hand, in the same order:
each weight's norm reduced over dp, then over tp (DTensor redistributes a partial norm
mesh dimension by mesh dimension, each weight before they are stacked), so the bits agree.
  weight_norms   this rank's norm of each gradient, made whole over dp and tp; by mesh
  clip_grad_norm_   the total over the groups and the stages, then every gradient scaled
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..tp.plan import SLICES


def _whole(norm, group):
    """The norm of the whole from each rank's norm of its part: (sum of squares) ** 0.5."""
    norm = norm ** 2
    dist.all_reduce(norm, group=group)
    return norm ** 0.5


def weight_norms(module, mesh):
    """{group: [norm of each gradient]} in module.parameters() order. A group is what stock
    keeps on one mesh: the weights of TP'd layers (a part or a copy over tp), the rest."""
    names = mesh.mesh_dim_names
    groups, seen = {}, set()
    for layer in module.modules():
        for attr, p in layer.named_parameters(recurse=False):
            if id(p) in seen or p.grad is None:
                continue  # a tied weight once; a weight without gradient adds nothing
            seen.add(id(p))
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            norm = torch.linalg.vector_norm(grad, 2.0)
            if isinstance(p.grad, DTensor) and "dp" in names:  # fully_shard's block of rows
                norm = _whole(norm, mesh["dp"].get_group())
            if isinstance(p.grad, DTensor) and "dp_shard" in names:  # HSDP's: a copy over
                norm = _whole(norm, mesh["dp_shard"].get_group())  # dp_replicate, counted once
            tp_layer = layer in SLICES
            if tp_layer and attr in SLICES[layer]:  # TP's slice (a copy, bias: as it is)
                norm = _whole(norm, mesh["tp"].get_group())
            groups.setdefault("tp layers" if tp_layer else "others", []).append(norm)
    return groups


@torch.no_grad()
def clip_grad_norm_(module, max_norm, mesh):
    """Scale every gradient of this rank's `module` so that the whole model's gradient
    (over every rank of `mesh`) has a 2-norm of at most max_norm; returns that norm (before
    clipping), the same on every rank. Collective: every rank of the mesh."""
    groups = weight_norms(module, mesh)
    per_group = [torch.linalg.vector_norm(torch.stack(norms), 2.0) for norms in groups.values()]
    total = sum((norm ** 2 for norm in per_group), torch.zeros(())) ** 0.5  # torchtitan's join
    if "pp" in mesh.mesh_dim_names:  # each stage its own weights: their squares add up
        total = total ** 2
        dist.all_reduce(total, group=mesh["pp"].get_group())
        total = total ** 0.5
    # clip_grads_with_norm_ takes the parameters (it scales their .grad): given the
    # gradients themselves, it would scale their .grad, None, and clip nothing. One gradient
    # at a time (foreach=False): _foreach_mul_ refuses DTensor gradients and a plain scale.
    params = [p for p in module.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total
