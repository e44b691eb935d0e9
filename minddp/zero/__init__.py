"""ZeRO-1: the optimizer state split over the ranks, the weights still whole.

    torchrun --nproc_per_node=2 examples/zero1.py
    pytest tests/test_zero.py           # bitwise stock ZeroRedundancyOptimizer's
    minddp zero-bench                   # optimizer-state bytes per rank, step times

Data parallelism keeps a whole optimizer on every rank. ZeRO stage 1 gives each rank the
state of some parameters only: each rank steps its own parameters, then broadcasts them to
the others. The split is stock ZeroRedundancyOptimizer's, so every weight is its bits.
Read in this order:
    optimizer.py  ShardedOptimizer: the parameters split, a step, the broadcasts
    state.py      its state dict: the shards' state as one plain optimizer's, and back
The example: examples/zero1.py. The docs page: docs/zero1.md. The exercise: minddp exercise
zero DIR. FSDP, which shards the weights too, is the chapter after this one (minddp/fsdp/).
"""
