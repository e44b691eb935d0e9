"""BucketedDDP: DDP the way stock DDP really does it, gradients in buckets that overlap backward.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # the lesson, wrapped with this class
    pytest tests/test_buckets.py                         # bitwise against stock DDP, 1-4 ranks

Read naive.py first: the contract and the three moves are the same. What changes is how
gradients travel. NaiveDDP sends each gradient alone and waits; here each gradient is
copied (already divided by world_size) into its place in a flat *bucket*, and a bucket
whose last gradient has come in is all-reduced *asynchronously*, while autograd goes on
computing the earlier layers' gradients. When backward ends we wait for every bucket and
copy the averages back into `.grad`. The layout is stock's (bucket_layout.py): one bucket for
the first backward, then buckets rebuilt once, in the order the gradients arrived.

One gradient's path reads down this file, and stock's other knobs (dropin/ddp.py) fill in
its extension points: _pack_buckets (who shares a bucket), _copy_into_bucket (how a gradient
enters it), _reduce_bucket and _wait_for_bucket (how a bucket is reduced, what comes back),
_copy_out_of_bucket (how the averages get back into .grad).
"""

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..launch.backends import move_to_device
from .broadcast import broadcast_buffers, broadcast_parameters, check_same_model
from .bucket_layout import Bucket, assign_buckets, bucket_size_limits, check_bucketable
from ..collectives import chosen  # whose all_reduce: torch's, or chapter 0's (--collectives)
from .grad_hooks import at_end_of_backward, missing_gradients_error, weakly
from ..launch.groups import global_rank
from .naive import NaiveDDP
from ..launch.usage_error import UsageError


class BucketedDDP(nn.Module):
    """DDP with gradients averaged in buckets, overlapped with backward: stock's algorithm.

    Collective: call on every rank.
    """

    def __init__(self, module, device_ids=None, broadcast_buffers=True, init_sync=True,
                 process_group=None, bucket_cap_mb=None):
        """Wrap `module` as NaiveDDP does; buckets of bucket_cap_mb (stock's names, defaults)."""
        super().__init__()
        self.device_ids = device_ids  # [i]: the module is on cuda:i; inputs are moved there
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True  # stock's flags, as in naive.py
        self.require_forward_param_sync = True
        if init_sync:
            check_same_model(module, process_group)
            broadcast_parameters(module, src=0, group=process_group, buffers=broadcast_buffers)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        check_bucketable(self._names, self._params)  # one clear error for a sparse parameter
        self.size_limits = bucket_size_limits(bucket_cap_mb)
        # Before any backward nobody knows in which order the gradients will arrive: one
        # bucket for everything, rebuilt after the first synced backward (_rebuild_buckets).
        self._build_buckets(self._pack_buckets([float("inf")]))
        self._rebuilt = False
        self._arrival_order = []  # parameter indices, in the order their gradients came
        self._sync_this_backward = False  # decided by forward, cleared when backward ends
        self._ready = set()  # indices whose bucket slot is filled in this backward
        for i, p in enumerate(self._params):
            hook = functools.partial(weakly(self._gradient_ready), i)  # (grad_hooks.py)
            p.register_post_accumulate_grad_hook(hook)

    def _pack_buckets(self, size_limits, order=None):
        return assign_buckets(self._params, size_limits, order)

    def _build_buckets(self, layout):
        self.buckets = [Bucket(self._params, indices) for indices in layout]
        # parameter index -> (its bucket, its view in that bucket)
        self._where = {i: (bucket, view) for bucket in self.buckets
                       for i, view in zip(bucket.indices, bucket.views)}
        self._next_bucket = 0  # the next bucket to launch in this backward

    # no_sync(): naive.py's, as it is: it lowers require_backward_grad_sync for the block
    no_sync = NaiveDDP.no_sync

    def forward(self, *args, **kwargs):
        """The module's forward; a training forward decides if the next backward syncs."""
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synced:
            self._rebuild_buckets()  # once, after the first synced backward
        if self.require_forward_param_sync and self.broadcast_buffers:
            broadcast_buffers(self.module, src=0, group=self.process_group)  # as in naive.py
        if torch.is_grad_enabled():
            self._sync_this_backward = synced  # decided at forward time, as stock does
        args, kwargs = move_to_device(args, kwargs, self.device_ids)
        output = self.module(*args, **kwargs)
        self.require_forward_param_sync = synced
        return output

    def _rebuild_buckets(self):
        if self._rebuilt or len(self._arrival_order) != len(self._params):
            return
        # Gradients arrive roughly last layer first. Buckets packed in that order fill up
        # (and leave) while backward is still busy with the layers below.
        order = torch.tensor(self._arrival_order, device=self._params[0].device)
        if self.world_size > 1:
            # Every rank must pack the same buckets, or the all_reduces would add up
            # different parameters; stock settles it the same way: rank 0's order wins.
            group = self.process_group
            dist.broadcast(order, src=global_rank(group, 0), group=group)
        self._build_buckets(self._pack_buckets(self.size_limits, order.tolist()))
        self._rebuilt = True

    def _gradient_ready(self, index, param):
        if not self._sync_this_backward:
            return  # inside no_sync(): the gradient stays in .grad and accumulates
        if not self._ready:  # the first gradient: at the end of backward, wait for all
            at_end_of_backward(self._end_of_backward)  # (grad_hooks.py)
        if not self._rebuilt:
            self._arrival_order.append(index)
        self._mark_ready(index)

    def _mark_ready(self, index):
        self._ready.add(index)
        bucket, view = self._where[index]
        self._copy_into_bucket(index, view)
        bucket.pending -= 1
        # Launch strictly in bucket order, the same on every rank: collectives pair up in
        # the order they are issued, so bucket 1 may not overtake bucket 0, even if ready.
        while (self._next_bucket < len(self.buckets)
               and self.buckets[self._next_bucket].pending == 0):
            bucket = self.buckets[self._next_bucket]
            bucket.work = self._reduce_bucket(bucket, self._next_bucket)
            self._next_bucket += 1

    def _copy_into_bucket(self, index, view):
        grad = self._params[index].grad
        if grad.is_sparse:  # an embedding's rows, a different set each step: no fixed place
            raise UsageError(f"{self._names[index]!r} has a sparse gradient",
                             hint="ManualDDP sends each sparse gradient alone, as stock does")
        # Divide while copying, in one pass: each rank sends g_r / world_size, so the sum
        # that comes back is the mean (stock multiplies by 1/world_size the same way).
        torch.mul(grad, 1.0 / self.world_size, out=view)

    def _reduce_bucket(self, bucket, position):
        if self.world_size == 1:
            return None
        # async_op: returns at once; the reduction runs in the backend's own thread
        # while autograd goes on computing the earlier layers' gradients.
        return chosen.all_reduce(bucket.flat, group=self.process_group, async_op=True)

    def _wait_for_bucket(self, bucket, position):
        if bucket.work is not None:
            bucket.work.wait()
        return bucket.flat

    def _end_of_backward(self):
        # Wait *before* anyone reads .grad: the optimizer must step with the average, not
        # with this rank's half-reduced buffer.
        missing = [n for i, n in enumerate(self._names) if i not in self._ready]
        for position, bucket in enumerate(self.buckets):
            flat = self._wait_for_bucket(bucket, position)
            if not missing:
                self._copy_out_of_bucket(bucket, flat)
        self._reset()
        if missing:  # a bucket that never filled was never sent: say so instead of hanging
            raise missing_gradients_error(missing)

    def _copy_out_of_bucket(self, bucket, flat):
        for param, average in zip(bucket.params, bucket.views_of(flat)):
            param.grad.copy_(average)  # back where the optimizer reads it

    def _reset(self):
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
        self._next_bucket = 0
        self._ready = set()
        self._sync_this_backward = False
        if len(self._arrival_order) != len(self._params):
            self._arrival_order = []  # an incomplete first backward teaches no order
