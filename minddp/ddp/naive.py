"""NaiveDDP: DistributedDataParallel in its simplest form, the teaching baseline.

    pytest tests/test_ddp.py                                  # bitwise against stock DDP
    minddp bench --contenders naive bucketed stock  # what it costs, timed

Not used in practice (bucketed.py is the real way), but the idea fits on a screen. Wrap
the model, train with the usual loop, and when `loss.backward()` returns, every parameter's
`.grad` holds the *average* of that gradient over all ranks. Each rank then takes the same
optimizer step from the same weights, so the replicas stay identical, never sending a weight
again. Three moves:
  1. at construction, copy rank 0's parameters and buffers to everyone (broadcast.py);
  2. on every parameter that requires grad, a hook that fires once its gradient is
     complete and averages it: g <- sum_r (g_r / world_size), one *blocking* all_reduce;
  3. forward is the wrapped module's forward (after rank 0's buffers are copied again).
Slow: every all_reduce pays a fixed cost, and backward stops while it waits. Its numbers
equal stock's bit for bit at 1 and 2 ranks; at 3+ the additions may run in another order.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..launch.backends import move_to_device
from .broadcast import broadcast_buffers, broadcast_parameters, check_same_model
from ..collectives import chosen  # whose all_reduce: torch's, or chapter 0's (--collectives)
from .grad_hooks import at_end_of_backward, missing_gradients_error, weakly
from ..launch.usage_error import UsageError


class NaiveDDP(nn.Module):
    """DDP with one blocking all_reduce per parameter: the teaching baseline.
    Collective: call on every rank."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True, init_sync=True,
                 process_group=None):
        """Wrap `module`, rank 0's weights copied to every rank (stock's argument names)."""
        super().__init__()
        self.device_ids = device_ids
        self.module = module  # stock's name: state_dict keys read "module.<name>" in both
        self.process_group, self.world_size = process_group, dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True  # stock's flag; no_sync() lowers it
        self.require_forward_param_sync = True  # stock's flag: sync buffers before this forward
        if init_sync:
            check_same_model(module, process_group)  # names the first mismatch, on every rank
            broadcast_parameters(module, src=0, group=process_group, buffers=broadcast_buffers)
        # One hook per *distinct* parameter: parameters() lists a tied weight once, and
        # autograd sums all its uses into one .grad before the hook fires, so a tied weight
        # is averaged once. Frozen parameters get no gradient: no hook, no communication.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        self._sync_this_backward = False  # decided by forward, cleared when backward ends
        self._arrived = set()  # ids of the parameters whose gradient came in this backward
        for p in self._params:
            p.register_post_accumulate_grad_hook(weakly(self._average_gradient))

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside this block only add to .grad; the next synced one averages the sum."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before  # restored, not set to True: blocks nest

    def forward(self, *args, **kwargs):
        """The module's forward, after rank 0's buffers are copied to every rank."""
        if self.require_forward_param_sync and self.broadcast_buffers:
            # Buffers are state that forward *updates* (BatchNorm's running statistics),
            # each rank from its own batch, so replicas drift apart. Stock copies rank 0's
            # buffers to everyone before a forward that follows a synced training forward.
            broadcast_buffers(self.module, src=0, group=self.process_group)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            # Decided at forward time, as stock does: a forward inside no_sync() gives a
            # backward that stays local, even if backward() runs after the block.
            self._sync_this_backward = synced
        args, kwargs = move_to_device(args, kwargs, self.device_ids)  # [i]: the inputs to cuda:i
        output = self.module(*args, **kwargs)
        self.require_forward_param_sync = synced  # eval and no_sync forwards: next one skips
        return output

    def _average_gradient(self, param):
        # "Post accumulate": param.grad already holds this backward's gradient plus whatever
        # no_sync() accumulated before: the very tensor the optimizer will read.
        if not self._sync_this_backward:
            return  # inside no_sync(): the gradient just stays in .grad and accumulates
        if not self._arrived:  # the first gradient: check at the end that all of them came
            at_end_of_backward(self._end_of_backward)  # (grad_hooks.py)
        self._arrived.add(id(param))
        grad = param.grad
        if grad.is_sparse:  # an embedding's rows, sent alone: ManualDDP's, not this lesson's
            raise UsageError("a sparse gradient (nn.Embedding(sparse=True)): NaiveDDP averages"
                             " dense ones", hint="ManualDDP sends each sparse gradient alone")
        # Divide *before* summing, as stock does: the sum that comes back is already the
        # mean, and no rank ever holds a world_size-times-larger sum (fp16 would overflow).
        grad.mul_(1.0 / self.world_size)
        if self.world_size > 1:
            # Blocking, and safe: autograd walks the same graph in the same order on every
            # rank, so the ranks' all_reduces pair up parameter by parameter.
            chosen.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)

    def _end_of_backward(self):
        arrived, self._arrived, self._sync_this_backward = self._arrived, set(), False
        missing = [n for n, p in zip(self._names, self._params) if id(p) not in arrived]
        if missing:  # its peers averaged it and this rank did not: the replicas would part
            raise missing_gradients_error(missing)
