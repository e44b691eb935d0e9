"""Teardown: a finished run exits, every rank, always; the order that makes it so.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # ends with ddp_teardown()
    pytest tests/test_exit.py                            # no gloo thread left; bounded exits

destroy_process_group() frees the group only if nothing else holds it. Whatever still does
(a DDP wrapper alive in a frame, a device mesh in one of DTensor's caches) frees it later, on
the main thread, at a moment nobody chose: joining gloo's threads there, the GIL held, can
deadlock with a thread that waits for the GIL, and the rank never exits. So ddp_teardown
runs after the function that held the models has returned, frees what still holds the
group (forget_dtensor_caches, gc), lets every rank arrive, and only then destroys it; and if
gloo's threads are still there (group_threads), it says so and bounds the exit.
"""

import faulthandler
import functools
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from .launch import print_rank

EXIT_BOUND_S = 60  # the longest a finished rank may take to exit (see ddp_teardown)
THREADS_END_S = 2  # how long gloo's threads may take to end after destroy_process_group


def ddp_teardown():
    """Free the process group, all ranks together. Collective: call on every rank.

    Call it after main() has returned. Stock DDP's reducer (C++) holds the group; were it
    the last holder, freeing the model would run the group's destructor on the main thread,
    GIL held, joining gloo's threads, one of which may wait for the GIL to free a finished
    collective's tensors: a deadlock (at exit, an abort). With every wrapper freed first,
    destroy_process_group() drops the last reference and lets go of the GIL meanwhile.
    """
    if not dist.is_initialized():
        return
    forget_dtensor_caches()  # stock fully_shard's device meshes hold the group
    gc.collect()  # a wrapper caught in a reference cycle is freed now, not at exit
    # Rank 0 may still be writing a table: every rank arrives before any tears down.
    nccl = dist.get_backend() == "nccl"
    dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)
    dist.destroy_process_group()
    # A gloo thread may take a moment to end after its group is freed (8 ranks on 2 cores:
    # it waits for a core); a group still held is one whose threads stay.
    deadline = time.monotonic() + THREADS_END_S
    while group_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_threads():
        # Something still holds the group (a DDP wrapper still alive): freeing it later
        # may deadlock as above. Say so, and bound the exit: faulthandler's watchdog (a
        # C thread, it needs no GIL) prints the stacks and exits with status 1.
        print_rank(f"warning: the process group outlived ddp_teardown() (something still"
                   f" holds it, e.g. a DDP model): call ddp_teardown() after the function"
                   f" that holds the model has returned; exiting within {EXIT_BOUND_S} s")
        faulthandler.dump_traceback_later(EXIT_BOUND_S, exit=True)


def forget_dtensor_caches():
    """Empty DTensor's sharding caches, which hold device meshes and so their process group."""
    # Stock fully_shard (FSDP2) and parallelize_module make DTensors; the first op on each
    # shape caches its sharding, whose device mesh holds the group, which then outlives its
    # destroy. The caches are private and differ between releases: every lru_cache of
    # DTensor's modules is emptied, and the two caches that are not lru_caches by name.
    if "torch.distributed.tensor" not in sys.modules:
        return  # never imported: nothing cached
    from torch.distributed.tensor import _redistribute, debug
    getattr(debug, "_clear_fast_path_sharding_prop_cache", lambda: None)()  # (C++)
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    for cached in gc.get_objects():
        if (type(cached) is functools._lru_cache_wrapper
                and getattr(cached, "__module__", "").startswith("torch.distributed.tensor")):
            cached.cache_clear()


def group_threads():
    """Names of this process's gloo threads still running (Linux; [] where unknown)."""
    names = []
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended while we looked
    return sorted(n for n in names if "gloo" in n)
