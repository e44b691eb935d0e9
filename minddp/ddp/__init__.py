"""Data parallelism: every rank a whole model, its own data, the gradients averaged.

    torchrun --nproc_per_node=2 examples/manual_ddp.py --grad-table runs/manual.txt
    torchrun --nproc_per_node=2 examples/stock_ddp.py --grad-table runs/stock.txt
    minddp diff runs/manual.txt runs/stock.txt            # IDENTICAL
    pytest tests/test_sampler.py tests/test_broadcast.py tests/test_ddp.py tests/test_buckets.py

Stock DistributedDataParallel by hand, in the three pieces lesson 9.3 names: each rank its
share of the data, the same starting weights on every rank, and every gradient averaged
over the ranks before the step. NaiveDDP does it one gradient at a time; BucketedDDP packs
the gradients into buckets and overlaps their all_reduce with the backward, as stock does.
Read in this order:
    sampler.py        ShardSampler: which examples each rank trains on
    broadcast.py      broadcast_parameters: rank 0's weights on every rank
    grad_hooks.py     how a wrapper hears of each gradient, and of the backward's end
    naive.py          NaiveDDP: one all_reduce per gradient, the teaching baseline
    bucket_layout.py  which gradients share a bucket, stock's way
    bucketed.py       BucketedDDP: buckets launched as they fill, in order
The examples: examples/manual_ddp.py beside examples/stock_ddp.py, and examples/accumulate.py,
examples/uneven.py, examples/break_ddp.py. The docs: docs/buckets.md, docs/timeline.md,
docs/uneven.md. The exercises: minddp exercise sampler|broadcast|naive|bucketed DIR.
"""
