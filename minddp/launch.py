"""Launching: torchrun's environment -> rank, local_rank, world_size, backend, device.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # 2 processes on this machine
    python examples/manual_ddp.py                        # 1 process, world size 1

torchrun starts one process per rank and tells each who it is through environment
variables. Two of them are easy to mix up:

    RANK        the global rank, 0..WORLD_SIZE-1 over all machines: decides who logs and saves
    LOCAL_RANK  the rank on this machine, 0..LOCAL_WORLD_SIZE-1:     picks the GPU (cuda:LOCAL_RANK)

The lesson's script uses LOCAL_RANK for both, which is right on one machine and wrong
on two: both machines would have a "rank 0" that saves.
"""

import datetime
import faulthandler
import functools
import gc
import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch._dynamo  # noqa: F401  (before any group: see the comment in ddp_setup)
import torch.distributed as dist

from .backends import choose_backend

DEFAULT_TIMEOUT_S = 120
ARRIVAL_TIMEOUT = datetime.timedelta(minutes=10)  # the longest a rank waits for its peers to start
EXIT_BOUND_S = 60  # the longest a finished rank may take to exit (see ddp_teardown)


@dataclass(frozen=True)
class DDPEnv:
    """Who this process is (rank, local_rank, world_size) and what it runs on (backend, device)."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout: float = DEFAULT_TIMEOUT_S  # seconds a collective waits for its peers

    def __str__(self):
        return f"world size {self.world_size} | {self.backend} on {self.device}"

    @property
    def device_ids(self):
        """Stock DDP's `device_ids`: [index] on CUDA, None otherwise (on CPU [rank] is refused)."""
        return [self.device.index] if self.device.type == "cuda" else None


def ddp_setup(backend="auto", device="auto", timeout=DEFAULT_TIMEOUT_S):
    """Read torchrun's environment, pick backend and device, start the process group.

    Collective: call on every rank. Without torchrun (plain `python script.py`) this is a
    world of one process. `timeout` (seconds) bounds a rank's wait for its peers.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend, device_name = choose_backend(
        backend, device, local_rank, local_world_size, world_size,
        cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        mps_available=torch.backends.mps.is_available(), windows=sys.platform == "win32")
    env = DDPEnv(rank, local_rank, world_size, backend, torch.device(device_name), timeout)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # before init: nccl binds to the current GPU
    # torch's default is 10 to 30 minutes: a rank whose peer died would sit that long in
    # its collective. The lesson's steps take milliseconds; two minutes is generous.
    timeout = datetime.timedelta(seconds=timeout)
    # torch._dynamo is imported at the top, before any group: imported later (torch.optim
    # does), it holds the group past destroy_process_group(); the exit can hang (torch 2.13).
    # nccl bound to its GPU from the start need not guess it from the rank (torch >= 2.3).
    bind = ({"device_id": env.device} if backend == "nccl"
            and "device_id" in inspect.signature(dist.init_process_group).parameters else {})
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            store=_store(rank, world_size), **bind)  # the lesson's call
    return env


def _store(rank, world_size):
    """Where the ranks meet: torchrun's address (env://), or, alone, an in-process store."""
    if "WORLD_SIZE" not in os.environ:
        return dist.HashStore()  # one process meets nobody: no port needed
    if sys.platform == "win32":
        os.environ["USE_LIBUV"] = "0"  # Windows builds ship the TCP store without libuv
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=ARRIVAL_TIMEOUT))
    # After a restart (torchrun --max-restarts) the workers meet in torchrun's store, which
    # holds the dead attempt's keys: gloo would dial the old peers. Each attempt gets its own
    # prefix. A store started anew each round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) needs
    # none, and must have none: a node that joins later counts attempts from 0, others not.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore(f"minddp/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    # Wait here until every rank has arrived: `timeout` is for a peer that stops taking part,
    # not for one still importing torch on a busy machine (17 s, measured at load 14).
    if store.add("arrived", 1) == world_size:
        store.set("all arrived", "yes")
    store.wait(["all arrived"])
    return store


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


def get_rank():  # the global rank, with or without a process group
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def print_rank(message):
    """Print on every rank, prefixed with "[rankN]", as one write.

    All ranks share the terminal; print() writes the text and the newline separately,
    so two ranks can interleave mid-line. One write of a short line cannot.
    """
    sys.stdout.write(f"[rank{get_rank()}] {message}\n")
    sys.stdout.flush()


def print0(*args, **kwargs):
    """print() on global rank 0 only: one copy of each log line, not WORLD_SIZE copies."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)
