"""The bucket layout: many small all_reduces packed into a few large ones, stock DDP's way.

    minddp bench --contenders naive bucketed stock    # what buckets buy, timed

Each all_reduce pays a fixed cost (a round trip between ranks, a kernel launch) on top of
its bytes. A model with hundreds of parameters pays it hundreds of times per step when
every gradient travels alone (naive.py's NaiveDDP). Buckets copy gradients into a few flat
buffers and all-reduce each buffer once, asynchronously, as soon as its last gradient is
ready, so communication runs while autograd is still computing the earlier layers.

Everything here copies PyTorch's reducer (torch/csrc/distributed/c10d/reducer.cpp and
DistributedDataParallel._ddp_init_helper), down to the byte offsets. That is not pedantry:
with three or more ranks an all_reduce adds each element's addends in an order that
depends on where the element sits in the buffer, so the same layout is what makes
BucketedDDP's gradients bitwise equal to stock's (tests/test_buckets.py).
"""

import torch

from ..launch.usage_error import UsageError

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
        self.flat = torch.empty(numel, dtype=first.dtype, device=first.device)
        self.views = self._split(self.flat)
        self.pending = len(self.params)  # gradients still to arrive in this backward
        self.work = None  # the async all_reduce, or the comm hook's future, in flight

    def views_of(self, flat):
        """Per-parameter views into `flat`, a tensor laid out like this bucket's buffer."""
        # the bucket's own buffer: its views, made once (a step would otherwise make them again)
        return list(self.views) if flat is self.flat else self._split(flat)

    def _split(self, flat):
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def nbytes(self):
        return self.flat.numel() * self.flat.element_size()


def check_bucketable(names, params):
    """Refuse, naming it, a parameter that no flat bucket can hold."""
    for name, p in zip(names, params):
        if p.layout != torch.strided:
            raise UsageError(f"parameter {name!r} is a {p.layout} tensor: ManualDDP's buckets"
                             f" hold dense (strided) parameters", hint="make it a dense parameter")
