"""Prefetching: a unit's all_gather issued early, on a thread of its own, while compute goes on.

    pytest tests/test_fsdp_example.py -k prefetch    # with prefetching: still stock's bits
    minddp fsdp-bench --world-sizes 2 --sizes 4M     # "FSDP prefetch": its step time

`set_modules_to_forward_prefetch([next, after_next])` on a unit asks: when my forward starts,
gather theirs too. Done on the main thread, that only moves the wait; here one background
thread runs the lesson's unshard() for them, so the all_gather travels while this unit
computes (gloo's collectives release the GIL), as stock overlaps it on another CUDA stream.

One rule keeps it correct: every rank must issue its collectives in the same order. The
thread runs the prefetches one at a time, in the order they were asked for, and the main
thread issues a collective of its own (a unit's unshard not prefetched, a reduce_scatter)
only after every prefetch asked so far has finished: wait_for_prefetches(). Both orders
then follow the program, which is the same on every rank.
"""

import time
from concurrent.futures import ThreadPoolExecutor

from ..fsdp import shard as fsdp

_thread = None
_in_flight = []  # (unit, future) in the order asked
# Seconds the prefetch thread spent gathering, and the main thread spent waiting for it:
# what is not waited for was hidden behind compute (read by minddp fsdp-bench).
seconds = {"gathering": 0.0, "waited": 0.0}


def prefetch(unit):
    """Start gathering `unit`'s weights on the prefetch thread (nothing if already whole)."""
    global _thread
    if unit.is_unsharded or any(u is unit for u, _ in _in_flight):
        return
    unit.adopt_registered_shards()  # (main thread: it may replace the shards)
    if _thread is None:
        _thread = ThreadPoolExecutor(1, thread_name_prefix="minddp-prefetch")
    _in_flight.append((unit, _thread.submit(_gather, unit)))


def _gather(unit):  # on the prefetch thread
    start = time.perf_counter()
    fsdp.Unit.unshard(unit)  # the lesson's, not the drop-in's (which waits for this thread)
    seconds["gathering"] += time.perf_counter() - start


def wait_for_prefetches():
    """Block until every prefetch asked so far has finished (re-raising its error)."""
    start = time.perf_counter()
    while _in_flight:
        _, future = _in_flight.pop(0)
        future.result()
    seconds["waited"] += time.perf_counter() - start
