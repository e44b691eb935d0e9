"""NaiveDDP: DistributedDataParallel in its simplest form, the teaching baseline.

    torchrun --nproc_per_node=2 examples/manual_ddp.py    # uses ManualDDP, built on this
    python -m minddp.bench --contenders naive bucketed stock

Not used in practice: ManualDDP (ddp.py) is the same contract, bucketed and overlapped.
The contract is stock DDP's: wrap the model, train with the usual loop, and when
`loss.backward()` returns, every parameter's `.grad` holds the *average* of that
gradient over all ranks. Each rank then takes the same optimizer step from the same
weights, so the replicas stay identical without ever sending a weight again.

How, in three moves:
  1. at construction, broadcast rank 0's parameters and buffers (broadcast.py), and
     rank 0's buffers again before each forward that follows a training step;
  2. on every parameter that requires grad, a hook that fires once its gradient for
     this backward pass is complete, and averages it: g <- sum_r (g_r / world_size),
     with one *blocking* all_reduce per parameter;
  3. forward is the wrapped module's forward, untouched.

Slow, for two reasons the benchmark shows: every all_reduce pays a fixed cost, and
backward stops while it waits. Its numbers equal stock's bit for bit at 1 and 2 ranks;
at 3 or more the additions may run in another order (last bits, see diff.py).
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .broadcast import broadcast_buffers, broadcast_parameters, check_same_model
from .errors import UsageError


class NaiveDDP(nn.Module):
    find_unused_parameters = False  # ManualDDP has the knob; here every parameter must be used

    def __init__(self, module, process_group=None, broadcast_buffers=True):
        super().__init__()
        self.module = module  # the name stock uses: state_dict keys read "module.<name>" in both
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True  # stock's flag; no_sync() lowers it
        self.require_forward_param_sync = True  # stock's flag: sync buffers before this forward
        check_same_model(module, process_group)  # names the first mismatch, on every rank
        broadcast_parameters(module, src=0, group=process_group, buffers=broadcast_buffers)
        # One hook per *distinct* parameter: parameters() lists a tied weight once, and
        # autograd sums all its uses into one .grad before the hook fires, so a tied
        # weight is averaged once, not once per use. Frozen parameters get no gradient,
        # so they get no hook (and no communication).
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.timeline = None  # a minddp.timeline.Timeline records into it when set
        self._expect_hooks = False  # set by a synced forward, cleared when its backward ends
        self._arrived = []  # indices of the gradients that arrived in this backward
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                              for i, p in enumerate(self._params)]

    def _make_hook(self, index):
        return lambda param: self._hook(index, param)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates local gradients; no communication.

        The next synced backward adds its gradient to the accumulated sum and averages
        that, so K micro-batches cost one round of all_reduce instead of K.
        """
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def forward(self, *args, **kwargs):
        if self.require_forward_param_sync and self.broadcast_buffers:
            # Buffers are state that forward *updates* (BatchNorm's running mean and
            # variance), each rank from its own batch, so replicas drift apart. Stock
            # copies rank 0's buffers to everyone before a forward that follows a
            # synced training forward (or is the first), so eval uses the same statistics.
            broadcast_buffers(self.module, src=0, group=self.process_group)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            # Decided at forward time, as stock does: a forward run inside no_sync()
            # gives a backward that stays local, even if backward() runs after the block.
            self._expect_hooks = synced
        output = self.module(*args, **kwargs)
        self.require_forward_param_sync = synced  # eval and no_sync forwards: next one skips
        return output

    def _hook(self, index, param):
        # "post accumulate": param.grad already holds this backward's gradient plus
        # whatever no_sync() accumulated before, the same tensor the optimizer will read.
        if not self._expect_hooks:
            return  # inside no_sync(): the gradient just stays in .grad and accumulates
        if not self._arrived:
            # First gradient of this backward: ask autograd to call us once the whole
            # backward is done, to check that every gradient came.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._arrived.append(index)
        self._average(index, param)

    def _average(self, index, param):
        grad = param.grad
        # Divide *before* summing, as stock does: each rank scales its own gradient by
        # 1/world_size, so the sum is already the mean and no rank ever holds the
        # world_size-times-larger sum (which could overflow in half precision).
        if grad.is_sparse:
            grad.div_(self.world_size)  # a sparse gradient (an embedding's): stock divides
        else:
            grad.mul_(1.0 / self.world_size)
        if self.world_size > 1:
            # Blocking: every rank calls this hook for the same parameters in the same
            # order (autograd walks the same graph everywhere), so the collectives pair
            # up. When it returns, this .grad is the average on every rank.
            start = self.timeline and self.timeline.now()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)
            if self.timeline:
                nbytes = grad.numel() * grad.element_size()
                end = self.timeline.now()
                self.timeline.add("communication", f"param {index}", start, end, bytes=nbytes)
                self.timeline.add("compute", "blocked: all_reduce", start, end, blocked=True)
        if grad.is_sparse and not grad.is_coalesced():
            param.grad = grad.coalesce()  # as gloo's sparse all_reduce returns it (see ddp.py)

    def _end_of_backward(self):
        self._expect_hooks = False
        arrived, self._arrived = set(self._arrived), []
        missing = [self._param_names[i] for i in range(len(self._params)) if i not in arrived]
        self._finish(complete=not missing)
        if missing and not self.find_unused_parameters:
            raise UsageError(
                f"parameter {missing[0]!r} requires grad but got no gradient in this backward"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                hint="use it in forward so it reaches the loss, or freeze it with"
                     " requires_grad_(False) before wrapping the model")

    def _finish(self, complete):
        """End of a synced backward; the naive way has nothing in flight."""
