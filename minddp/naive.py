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
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from .usage_error import UsageError
from .broadcast import broadcast_buffers, broadcast_parameters, check_same_model


class NaiveDDP(nn.Module):
    """DDP with one blocking all_reduce per parameter: the teaching baseline.

    Collective: call on every rank."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True, init_sync=True,
                 process_group=None):
        """Wrap `module`; rank 0's weights are copied to every rank. Stock's argument names.

        device_ids=[i]: the module lives on cuda:i, and forward moves its inputs there.
        """
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
        args, kwargs = move_to_device(args, kwargs, self.device_ids)  # device_ids=[i]: to cuda:i
        output = self.module(*args, **kwargs)
        self.require_forward_param_sync = synced  # eval and no_sync forwards: next one skips
        return output

    def _average_gradient(self, param):
        # "Post accumulate": param.grad already holds this backward's gradient plus whatever
        # no_sync() accumulated before: the very tensor the optimizer will read.
        if not self._sync_this_backward:
            return  # inside no_sync(): the gradient just stays in .grad and accumulates
        if not self._arrived:  # the first gradient: check at the end that all of them came
            # queue_callback (private, but stock DDP's Python side and FSDP use it too): the
            # autograd engine calls the function once, when this whole backward has finished.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._arrived.add(id(param))
        grad = param.grad
        # Divide *before* summing, as stock does: the sum that comes back is already the
        # mean, and no rank ever holds a world_size-times-larger sum (fp16 would overflow).
        if grad.is_sparse:  # an embedding's sparse gradient: stock divides, not multiplies
            grad.div_(self.world_size)
        else:
            grad.mul_(1.0 / self.world_size)
        if self.world_size > 1:
            # Blocking, and safe: autograd walks the same graph in the same order on every
            # rank, so the ranks' all_reduces pair up parameter by parameter.
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)
        if grad.is_sparse and not grad.is_coalesced():
            param.grad = grad.coalesce()  # as gloo's sparse all_reduce returns it

    def _end_of_backward(self):
        arrived, self._arrived, self._sync_this_backward = self._arrived, set(), False
        missing = [n for n, p in zip(self._names, self._params) if id(p) not in arrived]
        if missing:  # its peers averaged it and this rank did not: the replicas would part
            raise missing_gradients_error(missing)


def weakly(method):
    """`method`, holding its object weakly: a hook that does nothing once the wrapper is gone.

    A parameter holds its hooks. A hook holding the wrapper strongly closes a cycle (parameter
    -> hook -> wrapper -> module -> parameter) through the tensor's C++ side, where Python's
    garbage collector cannot see it: the wrapper, and the process group it holds, never go.
    """
    ref = weakref.WeakMethod(method)
    return lambda *args: None if ref() is None else ref()(*args)


def move_to_device(args, kwargs, device_ids):
    """The inputs moved to device_ids[0] (stock's forward does this when device_ids is set)."""
    if not device_ids:
        return args, kwargs
    device = torch.device("cuda", device_ids[0])
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tree_map(move, args), tree_map(move, kwargs)


def missing_gradients_error(missing):
    """The error for parameters that require grad but got none in a synced backward."""
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return UsageError(f"parameter {missing[0]!r} requires grad but got no gradient in this"
                      f" backward{more}",
                      hint="use it in forward so it reaches the loss, or freeze it with"
                           " requires_grad_(False) before wrapping the model (or pass"
                           " find_unused_parameters=True to ManualDDP, as to stock DDP)")
