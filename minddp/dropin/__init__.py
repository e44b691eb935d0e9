"""The drop-ins: stock PyTorch's whole contract on top of the lessons, for real training code.

For engineers who want to run their own script on minddp with one import swapped. The
lessons (ddp/naive.py, ddp/bucketed.py, fsdp/shard.py) teach one idea each; these classes
add, on top and without changing the lessons' arithmetic, everything stock's API promises besides:
    ddp.py            ManualDDP: stock DDP's constructor and knobs on BucketedDDP
    checks.py         stock DDP's argument checks and refusals, message for message
    bucket_extras.py  sparse gradients, bucket views, the GradBucket a comm hook receives
    comm_hooks.py     a communication hook written out (fp16), and how a hook's result is read
    unused.py         find_unused_parameters: which parameters a forward did not reach
    join.py           join(): uneven inputs by stock's protocol
    fsdp.py           minddp.fully_shard: mixed precision, tied weights, meta init, activation
                      checkpointing, stock's checks, on fsdp/shard.py
    fsdp_module.py    FSDPModule: stock's module API (unshard, prefetching, no-sync), refusals
    fsdp_prefetch.py  prefetching: the next units' all_gathers on a thread, in one order
    fsdp_checks.py    what minddp.fully_shard refuses: stock-only arguments, a stale optimizer
    hsdp.py           fully_shard on a 2-D mesh (HSDP): shard within a row, replicate down
                      the columns, stock's reduce_scatter then all_reduce
    sp_order.py       sequence parallel's LayerNorm gradients summed in stock's order
    static_graph.py   static_graph=True: stock's bookkeeping of a graph that never changes
Each is proved bitwise against stock in tests/ (test_contract, test_join, test_dropin,
test_fsdp, test_fsdp_example); docs/dropin.md and docs/fsdp.md show the swap.
"""
