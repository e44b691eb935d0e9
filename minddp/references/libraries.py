"""minddp's drop-ins beside stock's: the calls a composition needs, picked by name.

    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp=2,tp=2 --impl stock

compose.py builds a model's parallelism from whichever set it is given, so one function
trains minddp's composition and stock's side by side (examples/gpt_nd.py, tests/test_mesh.py).
"""

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed import pipelining as stock_pipelining
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.tensor import DTensor, parallel as stock_tp
from torch.nn.parallel import DistributedDataParallel

from torch.distributed._composable import checkpoint as stock_composable_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ..mesh import clip, device_mesh as minddp_mesh
from .. import pp as minddp_pp, tp as minddp_tp
from ..cp.context_parallel import context_parallel
from ..memory.recompute import checkpoint_module
from ..run import older_torch  # noqa: F401  (torch 2.11 and 2.12: stock's stages as 2.13's)
from ..dropin.ddp import ManualDDP
from ..dropin.fsdp import fully_shard
from .stock_context import context_parallel as stock_context_parallel


def _as_dtensor(p):
    """p's gradient as stock holds it; stock DDP over TP keeps each TP weight's local part
    as a Parameter (_st_info: its DTensor's spec), whose gradient is a plain local part."""
    spec = getattr(p, "_st_info", None)
    if spec is None or isinstance(p.grad, DTensor):
        return p.grad
    return DTensor.from_local(p.grad, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


@torch.no_grad()
def stock_clip_grad_norm_(module, max_norm, mesh):
    """torchtitan's clip_grad_norm_ on stock's calls: torch's norm per mesh (full_tensor()),
    the meshes joined (sum of squares, sqrt), the stages summed over pp; then torch's
    clip_grads_with_norm_. (torch.nn.utils.clip_grad_norm_ alone refuses gradients on two
    meshes: FSDP over TP.)"""
    by_mesh = {}
    for p in module.parameters():
        if p.grad is not None:
            grad = _as_dtensor(p)
            by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = sum((norm ** 2 for norm in norms), torch.zeros(())) ** 0.5
    if "pp" in mesh.mesh_dim_names:
        total = total ** 2
        dist.all_reduce(total, group=mesh["pp"].get_group())
        total = total ** 0.5
    # the parameters, as torchtitan passes them: clip_grads_with_norm_ scales their .grad;
    # one at a time: _foreach_mul_ refuses DTensor gradients and a plain tensor's scale
    torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters()
                                          if p.grad is not None], max_norm, total,
                                         foreach=False)
    return total


def stock_checkpoint_module(module, save_ops=()):
    """Stock's composable checkpoint on a module; save_ops: selective (stock's context_fn)."""
    if not save_ops:
        return stock_composable_checkpoint(module)
    return stock_composable_checkpoint(module, context_fn=functools.partial(
        create_selective_checkpoint_contexts, list(save_ops)))


LIBRARIES = {
    "manual": SimpleNamespace(init_device_mesh=minddp_mesh.init_device_mesh, tp=minddp_tp,
                              fully_shard=fully_shard, DDP=ManualDDP, pipelining=minddp_pp,
                              clip_grad_norm_=clip.clip_grad_norm_,
                              checkpoint=checkpoint_module, context_parallel=context_parallel),
    "stock": SimpleNamespace(init_device_mesh=stock_mesh, tp=stock_tp,
                             fully_shard=stock_fully_shard, DDP=DistributedDataParallel,
                             pipelining=stock_pipelining,
                             clip_grad_norm_=stock_clip_grad_norm_,
                             checkpoint=stock_checkpoint_module,
                             context_parallel=stock_context_parallel),
}
