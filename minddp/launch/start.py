"""Launching: torchrun's environment -> rank, local_rank, world_size, backend, device.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # 2 processes on this machine
    python examples/manual_ddp.py                        # 1 process, world size 1

torchrun starts one process per rank and tells each who it is through environment
variables. Two of them are easy to mix up:

    RANK        the global rank, 0..WORLD_SIZE-1 over all machines: decides who logs and saves
    LOCAL_RANK  the rank on this machine, 0..LOCAL_WORLD_SIZE-1:     picks the GPU (cuda:LOCAL_RANK)

The lesson's script uses LOCAL_RANK for both, which is right on one machine and wrong
on two: both machines would have a "rank 0" that saves. Where the ranks meet before the
group exists: rendezvous.py. The end of a run, the group freed last and every rank out:
teardown.py.
"""

import datetime
import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch._dynamo  # noqa: F401  (before any group: see the comment in ddp_setup)
import torch.distributed as dist

from .backends import choose_backend
from .rendezvous import meeting_store

DEFAULT_TIMEOUT_S = 120


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
                            store=meeting_store(rank, world_size), **bind)  # rendezvous.py
    return env


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
