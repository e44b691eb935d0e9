"""FSDP (ZeRO-3): each rank keeps a shard of every weight and gathers a layer in time.

    torchrun --nproc_per_node=2 examples/fsdp.py --grad-table runs/fsdp.txt
    pytest tests/test_fsdp.py tests/test_fsdp_example.py   # each shard fully_shard's, 1-4 ranks

ZeRO-1 split the optimizer; FSDP splits the weights and the gradients as well. Before a
unit's forward (and again before its backward) its shards are all-gathered into whole
weights; after its backward each gradient is reduce-scattered back into shards. The lesson
takes stock fully_shard's arguments and gives each rank the same shards, bit for bit; the
rest of stock's contract (mixed precision, prefetching, ...) is in minddp/dropin/fsdp.py.
Read in this order:
    shard.py  fully_shard by hand: unshard, reshard, reduce_scatter, as DTensor shards
    param.py  its bookkeeping: what one parameter holds, which unit a module is
The examples: examples/fsdp.py, examples/break_fsdp.py. The docs page: docs/fsdp.md. The
exercise: minddp exercise fsdp DIR.
"""
