"""References: what a lesson is proved against where stock PyTorch has no public twin.

For anyone checking a proof. Each is built from stock's own code or from one process on the
whole batch, never from the lesson it checks:
    moe.py            one process on the whole batch: expert parallelism's reference
    stock_context.py  stock's context_parallel with its private ring kernels on CPU
    libraries.py      minddp's mesh, TP, FSDP, DDP and pipeline beside stock's, by name: one
                      function builds either (the mesh capstone's proof)
"""
