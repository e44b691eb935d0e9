"""What ManualDDP's knobs add to the lesson's buckets: sparse gradients, bucket views, GradBucket.

    pytest tests/test_contract.py      # each knob bitwise against stock DDP's

bucket_layout.py packs dense gradients, stock's way. Stock's reducer does three more things
that only the drop-in needs: a sparse gradient (nn.Embedding(sparse=True)) travels in a
bucket of its own; gradient_as_bucket_view makes .grad a view of the bucket (`aliases`
tells whether it still is); and a comm hook receives a `GradBucket`.
"""

import collections

import torch

from ..ddp.bucket_layout import assign_buckets


def assign_buckets_with_sparse(params, size_limits, order=None, sparse=()):
    """assign_buckets(), with each index in `sparse` in a bucket of its own, where stock puts it.

    A sparse gradient is a list of (row index, row) pairs whose count changes from step to
    step: it has no fixed place in a flat buffer, so it travels alone, as a sparse tensor.
    Stock's walk emits it at its own place in the walk: after the dense buckets that closed
    before it, before those still open when the walk ends.
    """
    walk = list(range(len(params))) if order is None else list(order)
    dense = assign_buckets(params, size_limits, [i for i in walk if i not in sparse])
    closed, still_open, filled = [], [], collections.Counter()
    for bucket in dense:  # which buckets reached their limit (closed) in the walk
        key = (params[bucket[0]].dtype, params[bucket[0]].device)
        limit = size_limits[min(filled[key], len(size_limits) - 1)]
        filled[key] += 1
        nbytes = sum(params[i].numel() * params[i].element_size() for i in bucket)
        (closed if nbytes >= limit else still_open).append(bucket)
    position = {i: n for n, i in enumerate(walk)}
    buckets = sorted(closed + [[i] for i in walk if i in sparse],
                     key=lambda b: position[b[-1]]) + still_open
    return sorted(buckets, key=min) if order is None else buckets


def aliases(a, b):
    """Do two tensors share memory (stock's is_alias_of)?"""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def expects_sparse_gradient(module, param):
    """Will `param` get a sparse gradient? (nn.Embedding / EmbeddingBag with sparse=True)"""
    return any(getattr(m, "sparse", False) is True and m.weight is param
               for m in module.modules()
               if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)))


class GradBucket:
    """What a communication hook receives: stock's `dist.GradBucket`, in Python.

    PyTorch's own hooks (allreduce_hook, fp16_compress_hook, ...) call these methods, so
    they run on ManualDDP unchanged. A new one per hook call, as in stock: a hook may
    set_buffer() a compressed copy without touching the bucket itself.
    """

    def __init__(self, bucket, index, count):
        self._bucket, self._index, self._count = bucket, index, count
        self._buffer = bucket.flat

    def buffer(self):
        return self._buffer

    def set_buffer(self, tensor):
        self._buffer = tensor

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def parameters(self):
        return list(self._bucket.params)

    def gradients(self):
        return self._bucket.views_of(self._buffer)

    def lengths(self):
        return [p.numel() for p in self._bucket.params]

    def offsets(self):
        return [sum(self.lengths()[:i]) for i in range(len(self._bucket.params))]

    def sizes_list(self):
        return [p.shape for p in self._bucket.params]
