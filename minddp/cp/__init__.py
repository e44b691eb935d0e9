"""Context parallelism: the sequence cut over the ranks, attention round a ring.

    torchrun --nproc_per_node=2 examples/context.py --grad-table runs/cp.txt
    pytest tests/test_context.py tests/test_context_example.py   # bitwise stock's ring
    minddp cp-bench                   # work per rank, bytes round the ring

A sequence too long for one rank is cut into chunks. Attention needs every key for every
query, so the keys and values go round a ring of ranks, a block at a time; each block's
output is merged by its log-sum-exp. A zig-zag cut balances the causal mask's work.
Read in this order:
    blockwise.py          attention one block of keys at a time, and the merge
    ring.py               every rank sends to the next, receives from the previous
    ring_attention.py     ring attention, forward and backward, as one autograd op
    context_parallel.py   stock's context_parallel by hand: the inputs cut, SDPA the ring
The examples: examples/context.py, examples/break_context.py. The docs page: docs/context.md.
The exercise: minddp exercise ring_attention DIR.
"""
