"""Memory: activations dropped in the forward and recomputed in the backward.

    pytest tests/test_recompute.py    # gradients equal to torch.utils.checkpoint's, bit for bit
    minddp recompute-bench            # activations kept per block, by policy
    minddp memory --help              # what one rank holds: the memory planner (minddp/tools/)

A model's activations, kept from the forward for the backward, often outweigh its weights.
Recomputation keeps a block's inputs only and runs its forward again when the backward
needs what it dropped; a selective policy keeps the costly ops' outputs.
Read:
    recompute.py  checkpoint by hand: saved-tensor hooks, the full and selective policies
The example: examples/break_recompute.py. The docs page: docs/recompute.md. The
exercise: minddp exercise recompute DIR.
"""
