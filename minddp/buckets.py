"""Gradient buckets: many small all_reduces packed into a few large ones, stock DDP's way.

    torchrun --nproc_per_node=2 -m minddp.bench     # what buckets buy, measured

Each all_reduce pays a fixed cost (a round trip between ranks, a kernel launch) on top of
its bytes. A model with hundreds of parameters pays it hundreds of times per step when
every gradient travels alone (ddp.py's naive mode). Buckets copy gradients into a few flat
buffers and all-reduce each buffer once, asynchronously, as soon as its last gradient is
ready, so communication runs while autograd is still computing the earlier layers.

Everything here copies PyTorch's reducer (torch/csrc/distributed/c10d/reducer.cpp and
DistributedDataParallel._ddp_init_helper), down to the byte offsets. That is not pedantry:
with three or more ranks an all_reduce adds each element's addends in an order that
depends on where the element sits in the buffer, so the same layout is what makes
ManualDDP's gradients bitwise equal to stock's (tests/test_buckets.py).
"""

import torch
import torch.distributed as dist

MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # stock's bucket_cap_mb
FIRST_BUCKET_BYTES = 1 * MB  # dist._DEFAULT_FIRST_BUCKET_BYTES


def bucket_size_limits(bucket_cap_mb=None):
    """Byte limits for the rebuilt buckets: a small first bucket, then bucket_cap_mb each."""
    if bucket_cap_mb is None:
        # Small first bucket: the first gradients to arrive (the last layer's) are sent
        # at once instead of waiting for 25 MB of company, which would delay the start
        # of communication. Stock applies this only when bucket_cap_mb is left default.
        return [FIRST_BUCKET_BYTES, int(DEFAULT_BUCKET_CAP_MB * MB)]
    return [int(bucket_cap_mb * MB)]


def assign_buckets(params, size_limits, order=None):
    """Split parameter indices into buckets: reducer.cpp's compute_bucket_assignment_by_size.

    Walk the parameters in `order` (default: 0, 1, 2, ...), adding each to the open bucket
    of its dtype and device; close a bucket once it holds at least the current limit,
    then move to the next limit (the last one repeats). Returns lists of indices.
    """
    buckets, open_buckets = [], {}
    for i in (range(len(params)) if order is None else order):
        p = params[i]
        # One flat buffer holds one dtype on one device, so those are kept apart.
        b = open_buckets.setdefault((p.dtype, p.device), {"indices": [], "bytes": 0, "limit": 0})
        b["indices"].append(i)
        b["bytes"] += p.numel() * p.element_size()
        if b["bytes"] >= size_limits[b["limit"]]:  # ">=": the parameter that fills it stays in
            buckets.append(b["indices"])
            b.update(indices=[], bytes=0, limit=min(b["limit"] + 1, len(size_limits) - 1))
    buckets += [b["indices"] for b in open_buckets.values() if b["indices"]]
    if order is None:
        # Stock sorts by each bucket's smallest index; with one dtype the walk already did.
        buckets.sort(key=min)
    return buckets


class Bucket:
    """One flat buffer and a view into it per parameter, back to back, no padding."""

    def __init__(self, params, indices):
        self.indices = indices
        self.params = [params[i] for i in indices]
        numel = sum(p.numel() for p in self.params)
        first = self.params[0]
        self.buffer = torch.empty(numel, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(self.params)  # gradients still to arrive in this backward
        self.work = None  # the async all_reduce in flight, once launched

    def nbytes(self):
        return self.buffer.numel() * self.buffer.element_size()


class BucketReducer:
    """Fills buckets as gradients arrive, all-reduces each in order, copies results back.

    The first iteration uses a single bucket in parameter order, as stock does: before
    any backward has run, nobody knows in which order gradients will arrive. The order
    seen in that first synced backward is recorded, and from the next forward on the
    buckets are rebuilt in it, so bucket 0 fills first and is sent while autograd
    works on the layers below.
    """

    def __init__(self, params, process_group=None, bucket_cap_mb=None):
        self.params = params
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.size_limits = bucket_size_limits(bucket_cap_mb)
        self._initialize_buckets(assign_buckets(params, [float("inf")]))
        self.has_rebuilt_buckets = False
        self.ready_order = []  # parameter indices, in the order their gradients arrived

    def _initialize_buckets(self, bucket_indices):
        self.buckets = [Bucket(self.params, indices) for indices in bucket_indices]
        self.locator = {}  # parameter index -> (bucket, its view)
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):
                self.locator[i] = (bucket, view)
        self.next_bucket = 0

    def rebuild_buckets(self):
        """Once, before the second synced forward: buckets in gradient-arrival order."""
        if self.has_rebuilt_buckets or not self.params or len(self.ready_order) != len(self.params):
            return
        order = torch.tensor(self.ready_order, device=self.params[0].device)
        if self.world_size > 1:
            # Every rank must pack the same buckets or the all_reduces would pair up
            # different parameters; stock settles it the same way: rank 0's order wins.
            group = self.process_group
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast(order, src=src, group=group)
        self._initialize_buckets(assign_buckets(self.params, self.size_limits, order.tolist()))
        self.has_rebuilt_buckets = True

    def grad_ready(self, index, grad):
        if not self.has_rebuilt_buckets:
            self.ready_order.append(index)
        bucket, view = self.locator[index]
        # Divide while copying into the bucket, one pass over the gradient: each rank
        # sends g_r / world_size, so the sum that comes back is already the mean.
        torch.mul(grad, 1.0 / self.world_size, out=view)
        bucket.pending -= 1
        # Launch strictly in bucket order, on every rank the same: collectives pair up by
        # the order they are issued, so bucket 1 may not overtake bucket 0 even if ready.
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            b = self.buckets[self.next_bucket]
            if self.world_size > 1:
                # async_op: returns at once; the reduction runs in the backend's own
                # thread while autograd goes on computing the earlier layers' gradients.
                b.work = dist.all_reduce(b.buffer, op=dist.ReduceOp.SUM,
                                         group=self.process_group, async_op=True)
            self.next_bucket += 1

    def finalize(self, copy_back=True):
        """End of backward: wait for every bucket, copy the averages into .grad.

        copy_back=False only waits and resets, after a backward that went wrong.
        """
        for bucket in self.buckets:
            if bucket.work is not None:
                # Wait before anyone reads .grad: the optimizer must step with the
                # average, not with this rank's half-reduced buffer.
                bucket.work.wait()
            if copy_back:
                for p, view in zip(bucket.params, bucket.views):
                    p.grad.copy_(view)
            bucket.pending, bucket.work = len(bucket.params), None
        self.next_bucket = 0
        if len(self.ready_order) != len(self.params):
            self.ready_order = []  # an incomplete first backward teaches no order
