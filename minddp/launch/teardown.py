"""Teardown: a finished run exits, every rank, always; the order that makes it so.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # ends with ddp_teardown()
    pytest tests/test_exit.py                            # no gloo thread left; bounded exits

destroy_process_group() frees the group only if nothing else holds it. Whatever still does
(a DDP wrapper alive in a frame, a device mesh in one of DTensor's caches) frees it later, on
the main thread, at a moment nobody chose: joining gloo's threads there, the GIL held, can
deadlock with a thread that waits for the GIL, and the rank never exits. So ddp_teardown
runs after the function that held the models has returned, frees what still holds the
group (forget_dtensor_caches, gc), lets every rank arrive, and only then destroys it; and if
gloo's threads are still there (group_threads), it says so and bounds the exit. On torch
2.11 and 2.12, stock's DTensor itself keeps device meshes past their use (stock_leaked_meshes):
ddp_teardown lets go of their groups and names stock's leak in one line.
"""

import faulthandler
import functools
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from .start import print_rank

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
    leaked = stock_leaked_meshes()  # torch 2.11 and 2.12 only: none on a later torch
    for mesh in leaked:
        let_go_of_groups(mesh)  # before destroy: the group must die inside it (see above)
    rank = dist.get_rank()
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
    elif leaked and rank == 0:  # the same on every rank: said once
        print(f"note: stock's DTensor (torch {torch.__version__}) leaked {len(leaked)} device"
              f" mesh(es) holding the process group; ddp_teardown() let go of the group",
              flush=True)


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
    for cached in _dtensor_caches() + _FROZEN_CACHES:
        cached.cache_clear()


def _dtensor_caches():
    return [c for c in gc.get_objects() if type(c) is functools._lru_cache_wrapper
            and getattr(c, "__module__", "").startswith("torch.distributed.tensor")]


_FROZEN_CACHES = []  # made before gc.freeze(): gc.get_objects() no longer lists them


def freeze_imported():
    """gc.freeze() all made so far (run/warm.py's fork server, after its imports): a rank's
    collections then skip the ~300k objects torch's import made, and copy none of their pages."""
    _FROZEN_CACHES.extend(_dtensor_caches())
    gc.freeze()


def stock_leaked_meshes():
    """The device meshes that only stock's DTensor dispatch (C++) still holds: torch < 2.13."""
    # Torch 2.11's and 2.12's C++ sharding cache keeps a reference to the arguments of each op
    # it propagates (DTensorSpecs and OpStrategies, in tuples on 2.11, lists on 2.12), which no
    # call, the cache's own clear included, gives back; each spec holds its mesh, each mesh
    # its process groups. A mesh counts as stock's leak only if every chain of holders above
    # it runs through those classes to such a tuple or list that no Python object holds: a
    # live DTensor, module, frame or global on the way is a holder of the program's own, and
    # its mesh is left alone.
    if torch.__version__ >= "2.13" or "torch.distributed.device_mesh" not in sys.modules:
        return []
    gc.unfreeze()  # every holder must be seen: gc.get_referrers() skips frozen objects
    from torch.distributed.device_mesh import DeviceMesh
    # (type(), not isinstance: that reads __class__, and torch.distributed.reduce_op warns)
    meshes = [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]
    # (torch 2.12's decomposition tracer keeps a fake mesh of its own that has no group:
    # holding nothing, it is no leak, whoever holds it)
    meshes = [m for m in meshes if _held_groups(m)]
    frontier, seen = meshes, {id(m) for m in meshes}
    for _ in range(32):  # the chains are 2 to 7 deep; a longer one is not this leak
        if not frontier:
            return meshes  # every chain ended in a tuple only C++ holds
        holders = python_holders(frontier, meshes)
        held = {id(x) for h in holders for x in gc.get_referents(h)}
        if any(id(o) not in held and type(o) not in (tuple, list) for o in frontier):
            return []  # held from outside Python, and not by one of the cache's sequences
        if any(type(h) not in (tuple, list, dict) and type(h).__module__ not in _STOCK_INNER
               for h in holders):
            return []  # a DTensor, a module, a frame...: the program still holds it
        frontier = [h for h in holders if id(h) not in seen]
        del holders  # a list of this function's: the next look must not count it a holder
        seen.update(id(h) for h in frontier)
    return []


# Where the classes between the leaked tuples and a mesh live (specs, strategies, meshes).
_STOCK_INNER = ("torch.distributed.tensor._op_schema", "torch.distributed.tensor._dtensor_spec",
                "torch.distributed.device_mesh", "torch.distributed._mesh_layout")


def python_holders(objects, *ours):
    """The Python objects that hold any of `objects`, other than `ours` and this call's own."""
    key = object()  # in whatever this call makes (get_referrers' argument tuple): left out
    found = gc.get_referrers(key, *objects)
    return [h for h in found if h is not objects and all(h is not o for o in ours)
            and not any(x is key for x in gc.get_referents(h))]


def let_go_of_groups(mesh):
    """Drop a leaked mesh's references to its process groups (it can never run again)."""
    for held, name in _held_groups(mesh):
        del held[name]


def _held_groups(mesh):
    """[(dict, key)] for each process group a mesh holds: its _pg_registry, name -> group."""
    return [(held, k) for held in vars(mesh).values() if isinstance(held, dict)
            for k, v in held.items() if isinstance(v, dist.ProcessGroup)]


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
