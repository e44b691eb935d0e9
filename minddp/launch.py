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
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backends import choose_backend
from .workarounds import forget_dtensor_caches, group_threads, init_workarounds

DEFAULT_TIMEOUT_S = 120
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
        """What stock DDP's `device_ids` wants: [index] for a CUDA module, None otherwise.

        The lesson passes `device_ids=[rank]` unconditionally; on CPU, DDP rejects that.
        """
        return [self.device.index] if self.device.type == "cuda" else None


def ddp_setup(backend="auto", device="auto", timeout=DEFAULT_TIMEOUT_S):
    """Read torchrun's environment, pick backend and device, start the process group.

    Collective: call on every rank.

    Without torchrun (plain `python script.py`) this is a world of one process.
    `timeout` (seconds) bounds how long a rank waits in a collective for its peers.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    backend, device_name = choose_backend(
        backend, device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        world_size,
        cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        mps_available=torch.backends.mps.is_available(), windows=sys.platform == "win32")
    env = DDPEnv(rank, local_rank, world_size, backend, torch.device(device_name), timeout)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # before init: nccl binds to the current GPU
    # torch's default is 10 to 30 minutes: a rank whose peer died would sit that long in
    # its collective. The lesson's steps take milliseconds; two minutes is generous.
    timeout = datetime.timedelta(seconds=timeout)
    # The lesson's call. What some machines and torch versions need beyond it (the store
    # of this torchrun attempt, nccl's device binding, ...) is one named call, explained
    # in workarounds.py.
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            **init_workarounds(backend, env.device, rank, world_size, timeout))
    return env


def ddp_teardown():
    """Free the process group, all ranks together. Call it after main() has returned.

    Collective: call on every rank.

    Order matters. Stock DDP's reducer is C++ and holds the process group. Were it the
    last holder, freeing the model (when main()'s frame ends) would run the group's
    destructor on the main thread, holding Python's GIL, and that destructor joins
    gloo's worker threads, one of which may still be freeing a finished collective's
    tensors and waiting for the GIL: a deadlock (at interpreter exit, an abort). With
    every wrapper freed first, destroy_process_group() drops the last reference from
    Python, which lets go of the GIL while the threads are joined.
    """
    if not dist.is_initialized():
        return
    forget_dtensor_caches()  # stock fully_shard's device meshes hold the group
    gc.collect()  # a wrapper caught in a reference cycle is freed now, not at exit
    # Rank 0 may still be busy (writing a table) while the others are done: let every
    # rank arrive before any tears its connections down.
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


def get_rank():
    """The global rank, with or without a process group."""
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
