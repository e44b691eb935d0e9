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
import os
import platform
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import UsageError


@dataclass(frozen=True)
class DDPEnv:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def device_ids(self):
        """What stock DDP's `device_ids` wants: [index] for a CUDA module, None otherwise.

        The lesson passes `device_ids=[rank]` unconditionally; on CPU, DDP rejects that.
        """
        return [self.device.index] if self.device.type == "cuda" else None


def choose_backend(backend, device, local_rank, local_world_size, world_size,
                   cuda_count, mps_available, windows):
    """Pick (backend, device string) for one rank. Pure: the tests call it with a fake machine.

    backend: "auto" | "nccl" | "gloo";  device: "auto" | "cuda" | "cpu" | "mps".
    """
    enough_gpus = 0 < cuda_count and local_world_size <= cuda_count
    if backend == "auto":
        # nccl is the fast path, but only for one GPU per process and never on Windows.
        want_gpu = device in ("auto", "cuda")
        backend = "nccl" if enough_gpus and want_gpu and not windows else "gloo"

    if backend == "nccl":
        if windows:
            raise UsageError("nccl does not run on Windows", hint="use --backend gloo")
        if cuda_count == 0:
            raise UsageError("nccl needs CUDA, but torch.cuda.is_available() is False here",
                             hint="leave --backend at auto (gloo on CPU), or install a CUDA build of PyTorch",
                             same_on_every_rank=True)
        if local_rank >= cuda_count:
            # The lesson's script dies here with "CUDA error: invalid device ordinal".
            raise UsageError(f"more ranks than GPUs: local rank {local_rank} needs cuda:{local_rank}, "
                             f"but this machine has {cuda_count} GPU(s)",
                             hint=f"torchrun --nproc_per_node={cuda_count} ..., or --backend gloo to share GPUs or use the CPU")
        if device not in ("auto", "cuda"):
            raise UsageError(f"nccl moves CUDA tensors only, not {device} tensors",
                             hint="use --backend gloo with --device cpu", same_on_every_rank=True)
        return "nccl", f"cuda:{local_rank}"

    if backend != "gloo":
        raise UsageError(f"unknown backend {backend!r}", hint="choose auto, gloo or nccl",
                         same_on_every_rank=True)
    if device == "cuda":
        if cuda_count == 0:
            raise UsageError("--device cuda, but torch.cuda.is_available() is False here",
                             hint="use --device cpu", same_on_every_rank=True)
        # gloo can share one GPU between several processes (nccl cannot).
        return "gloo", f"cuda:{local_rank % cuda_count}"
    if device == "mps" or (device == "auto" and mps_available and world_size == 1):
        if not mps_available:
            raise UsageError("--device mps, but torch.backends.mps.is_available() is False here",
                             hint="use --device cpu", same_on_every_rank=True)
        if world_size > 1:
            # No backend moves mps tensors between processes: Apple silicon runs one process.
            raise UsageError("mps runs a single process; no backend all-reduces mps tensors",
                             hint="run with plain python (world size 1), or --device cpu",
                             same_on_every_rank=True)
        return "gloo", "mps"
    if device == "auto" and enough_gpus:
        return "gloo", f"cuda:{local_rank}"  # Windows with GPUs: the lesson's gloo + set_device path
    if device not in ("auto", "cpu"):
        raise UsageError(f"unknown device {device!r}", hint="choose auto, cpu, cuda or mps",
                         same_on_every_rank=True)
    return "gloo", "cpu"


def import_dynamo_first():
    """Import torch._dynamo now, before a process group exists (see the comment inside)."""
    # torch 2.13: importing torch._dynamo while a process group exists keeps a reference
    # to the group after destroy_process_group(), so its gloo threads keep running, and
    # the interpreter's exit then now and then aborts ("terminate called without an
    # active exception", SIGABRT). torch.optim imports it when the first optimizer is
    # built, after ddp_setup(); importing it before the group avoids that.
    import torch._dynamo  # noqa: F401


DEFAULT_TIMEOUT_S = 120
_timeout_s = DEFAULT_TIMEOUT_S


def timeout_s():
    """The process-group timeout in force, in seconds."""
    return _timeout_s


def ddp_setup(backend="auto", device="auto", timeout=DEFAULT_TIMEOUT_S):
    """Read torchrun's environment, pick backend and device, start the process group.

    Without torchrun (plain `python script.py`) this is a world of one process.
    `timeout` (seconds) bounds how long a rank waits in a collective for its peers.
    """
    global _timeout_s
    launched = "WORLD_SIZE" in os.environ  # torchrun sets it for every worker
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    windows = platform.system() == "Windows"

    backend, device_name = choose_backend(
        backend, device, local_rank, local_world_size, world_size,
        cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        mps_available=torch.backends.mps.is_available(), windows=windows)
    device = torch.device(device_name)
    if device.type == "cuda":
        # Before init: nccl binds each process to the GPU that is current when it starts.
        torch.cuda.set_device(device)
    if windows:
        os.environ["USE_LIBUV"] = "0"  # Windows builds of PyTorch ship the TCP store without libuv

    # torch's default is 10 to 30 minutes (by version and backend): a rank whose peer
    # died or diverged would sit that long in its collective. The lesson's steps take
    # milliseconds; two minutes is generous and still fails fast enough to notice.
    _timeout_s = timeout
    timeout = datetime.timedelta(seconds=timeout)
    import_dynamo_first()
    if launched:
        # torchrun set MASTER_ADDR and MASTER_PORT: every rank meets there (env://).
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        # After a restart (torchrun --max-restarts) the workers meet in the same store,
        # which still holds the dead attempt's entries: gloo would read the old peers'
        # addresses and fail with "connectFullMesh ... Connection refused" (torch 2.13).
        # A key prefix per attempt keeps each attempt's entries apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"minddp/attempt{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        # One process meets nobody: an in-process store needs no port, so two plain
        # `python` runs never collide on MASTER_PORT.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return DDPEnv(rank, local_rank, world_size, backend, device)


def ddp_teardown():
    """Free the process group (the lesson's destroy_process_group), all ranks together."""
    if dist.is_initialized():
        # Rank 0 may still be busy (writing a table) while the others are done: let every
        # rank arrive before any tears its connections down.
        dist.barrier()
        dist.destroy_process_group()


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
