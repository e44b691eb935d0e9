"""What torch needs beyond the lesson's few lines: version-specific fixes, each with its why.

    python examples/manual_ddp.py    # ddp_setup() and ddp_teardown() call these

Each function here works around one measured behaviour of a torch release (2.13 unless
said otherwise). They are not part of the lesson; launch.py calls them so that the
lesson's setup and teardown stay short.
"""

import inspect
import os
import platform
import sys

import torch.distributed as dist


def init_workarounds(backend, device, rank, world_size, timeout):
    """Extra init_process_group() arguments, after the fixes that must come before it."""
    import_dynamo_first()
    windows_store_without_libuv()
    if "WORLD_SIZE" in os.environ:  # torchrun set it, and MASTER_ADDR/PORT: meet there
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = attempt_store(store)
    else:  # one process meets nobody: an in-process store needs no port
        store = dist.HashStore()
    return {"store": store, **bind_device_kwargs(backend, device)}


def import_dynamo_first():
    """Import torch._dynamo before a process group exists (torch 2.13)."""
    # torch.optim imports torch._dynamo when the first optimizer is built. Imported
    # while a group exists, it keeps a reference to that group after
    # destroy_process_group(), so the group's gloo threads live on until the
    # interpreter exits, and freeing the group then can hang or abort ("terminate
    # called without an active exception"). Imported before the group, it holds none.
    import torch._dynamo  # noqa: F401


def attempt_store(store):
    """Give each torchrun restart attempt its own keys in the rendezvous store."""
    # After a restart (torchrun --max-restarts) the workers meet in the same store,
    # which still holds the dead attempt's entries: gloo would read the old peers'
    # addresses and fail with "connectFullMesh ... Connection refused" (torch 2.13).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"minddp/attempt{attempt}", store)


def windows_store_without_libuv():
    """Windows builds of PyTorch ship the TCP store without libuv: ask for the other one."""
    if platform.system() == "Windows":
        os.environ["USE_LIBUV"] = "0"


def bind_device_kwargs(backend, device):
    """init_process_group's `device_id` for nccl, where this torch version takes it (>= 2.3)."""
    # Without it, nccl guesses each rank's GPU from its global rank ("Guessing device ID
    # based on global rank. This can cause a hang if rank to GPU mapping is
    # heterogeneous") and the first barrier warns that it uses "the device under current
    # context". Bound, the group knows its GPU from the start.
    takes_device_id = "device_id" in inspect.signature(dist.init_process_group).parameters
    if backend != "nccl" or not takes_device_id:
        return {}
    return {"device_id": device}


def forget_dtensor_caches():
    """Empty DTensor's sharding caches, which hold device meshes and so their process group."""
    # Stock fully_shard (FSDP2) makes DTensors; the first op on each shape caches its
    # sharding, whose device mesh holds the group: after destroy_process_group() the
    # group's gloo threads would live on, as in import_dynamo_first().
    if "torch.distributed.tensor" not in sys.modules:
        return  # never imported: nothing cached
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop, debug
    # (private names, so each is looked up, and skipped where a release lacks it)
    for clear in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):
        getattr(debug, clear, lambda: None)()
    for cached in (getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached",
                           None), getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh",
                           None)):
        getattr(cached, "cache_clear", lambda: None)()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()


def group_threads():
    """Names of this process's gloo threads still running (Linux; [] where unknown)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended while we looked
    return sorted(n for n in names if "gloo" in n)
