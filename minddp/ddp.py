"""ManualDDP: stock DistributedDataParallel by hand, with buckets that overlap backward.

    torchrun --nproc_per_node=2 examples/manual_ddp.py

The contract and the moves are NaiveDDP's (naive.py: broadcast at construction, a hook
per parameter, forward untouched); read that first. What changes is step 2, how the
gradients travel. Instead of one blocking all_reduce per parameter, each hook copies
its gradient into a flat bucket, and a full bucket is all-reduced *asynchronously*
while autograd goes on computing the gradients of the layers below (buckets.py). At
the end of backward every bucket is waited for and the averages are copied back.

Its numbers equal stock's bit for bit at any world size (tests/test_buckets.py): the
buckets are laid out as stock lays them out, so the additions run in the same order.
"""

import torch

from .buckets import BucketReducer
from .naive import NaiveDDP


class ManualDDP(NaiveDDP):
    def __init__(self, module, process_group=None, bucket_cap_mb=None):
        super().__init__(module, process_group)
        self.reducer = BucketReducer(self._params, process_group, bucket_cap_mb)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.reducer.rebuild_buckets()  # once, after the first synced backward
        return super().forward(*args, **kwargs)

    def _average(self, index, grad):
        self.reducer.grad_ready(index, grad)  # into its bucket; a full bucket is sent

    def _finish(self, complete):
        # Wait for every bucket before anyone reads .grad; after a backward that missed
        # a parameter, only wait and reset (the error follows).
        self.reducer.finalize(copy_back=complete)
