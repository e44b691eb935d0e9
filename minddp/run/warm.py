"""Ranks that start warm: forked from a process that has imported torch and minddp already.

    pytest tests/test_warm.py         # a warm rank's start, and that it is a fresh rank

Spawning a rank starts a new interpreter that imports torch: 2-3 s on a quiet 2-core
machine, 10-20 s on a loaded one, for every rank of every group a test, a grade or a
benchmark starts. multiprocessing's forkserver starts one server process, imports the
modules below there once (its preload), and forks each rank from it: the rank starts with
torch imported. The server is single-threaded and has run no torch operation (no OpenMP
pool, no CUDA context), so nothing is copied half-started; each rank still makes its own
process group, sets its own threads and device, and is torn down as before. The server's
last import (frozen.py) moves every object made so far out of the collector's sight
(gc.freeze): a rank's gc.collect() in ddp_teardown then reads its own objects only, not the
~300k of torch's import, and writes none of their pages (a copy per rank, after a fork).
"""

import multiprocessing
from multiprocessing import forkserver

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "torch.distributed.optim", "torch.nn.parallel", "minddp", "minddp.launch.start",
           "minddp.launch.teardown", "minddp.grader.checks",
           "minddp.run.frozen"]  # last: sets aside from the collector all imported before it


def context(start=False):
    """multiprocessing's forkserver context, the server preloading torch and minddp.
    start=True starts the server now: its imports run beside what this process does next."""
    # Read when the server starts (the first rank started through it); a no-op after.
    multiprocessing.set_forkserver_preload(PRELOAD)
    if start:
        forkserver.ensure_running()
    return multiprocessing.get_context("forkserver")
