"""ManualDDP: DistributedDataParallel rebuilt from a broadcast and an all_reduce hook.

    torchrun --nproc_per_node=2 examples/manual_ddp.py

Its contract is stock DDP's: wrap the model, train with the usual loop, and when
`loss.backward()` returns, every parameter's `.grad` holds the *average* of that
gradient over all ranks. Each rank then takes the same optimizer step from the same
weights, so the replicas stay identical without ever sending a weight again.

How, in three moves:
  1. at construction, broadcast rank 0's parameters and buffers (broadcast.py);
  2. on every parameter that requires grad, a hook that fires once its gradient for
     this backward pass is complete, and all-reduces it: g <- sum_r (g_r / world_size);
  3. forward is the wrapped module's forward, untouched.

This file is the teaching baseline: one all_reduce per parameter, each blocking.
Stock DDP packs gradients into buckets and overlaps their all_reduce with the rest
of backward, which is faster. The numbers agree: bit for bit at 1 and 2 ranks; at 3 or
more, up to the order in which the all_reduce adds (last-bit differences, see diff.py).
"""

import torch
import torch.distributed as dist
from torch import nn

from .broadcast import broadcast_parameters


class ManualDDP(nn.Module):
    def __init__(self, module, process_group=None):
        super().__init__()
        self.module = module  # the name stock uses: state_dict keys read "module.<name>" in both
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_parameters(module, src=0, group=process_group)
        # One hook per *distinct* parameter: parameters() lists a tied weight once, and
        # autograd sums all its uses into one .grad before the hook fires, so a tied
        # weight is averaged once, not once per use. Frozen parameters get no gradient,
        # so they get no hook (and no communication).
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._average_grad)
            for p in module.parameters() if p.requires_grad
        ]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _average_grad(self, param):
        # "post accumulate": param.grad already holds this backward's gradient (plus
        # whatever was accumulated before), the same tensor the optimizer will read.
        # Divide *before* summing, as stock does: each rank scales its own gradient by
        # 1/world_size, so the sum is already the mean and no rank ever holds the full,
        # world_size-times-larger sum (which could overflow in half precision).
        param.grad.mul_(1.0 / self.world_size)
        if self.world_size > 1:
            # Blocking: every rank calls this hook for the same parameters in the same
            # order (autograd walks the same graph everywhere), so the collectives pair
            # up. When it returns, this .grad is the average on every rank.
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
