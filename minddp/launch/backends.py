"""Which backend and device a rank uses: the portability rules in one place.

    pytest tests/test_launch.py      # every rule, on fake machines (choose_backend is pure)

The lesson's script hard-codes nccl and `cuda:rank`, which runs on a Linux box with one
GPU per process and nowhere else. The rules below pick what each machine can run:

    machine                         backend  device
    Linux, a GPU per local rank     nccl     cuda:LOCAL_RANK
    fewer GPUs than local ranks     gloo     cpu (or, with --device cuda, GPUs shared)
    Windows with GPUs               gloo     cuda:LOCAL_RANK
    Apple silicon, one process      gloo     mps
    anything else                   gloo     cpu

A choice the machine cannot honour (nccl without CUDA, more nccl ranks than GPUs, mps
in several processes) is a UsageError with a hint, before any process group exists.
"""

from .usage_error import UsageError


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
                             hint="leave --backend at auto (gloo on CPU),"
                                  " or install a CUDA build of PyTorch",
                             same_on_every_rank=True)
        if local_rank >= cuda_count:
            # The lesson's script dies here with "CUDA error: invalid device ordinal".
            raise UsageError(f"more ranks than GPUs: local rank {local_rank} needs"
                             f" cuda:{local_rank}, "
                             f"but this machine has {cuda_count} GPU(s)",
                             hint=f"torchrun --nproc_per_node={cuda_count} ...,"
                                  " or --backend gloo to share GPUs or use the CPU")
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
        # Windows with GPUs: the lesson's gloo + set_device path
        return "gloo", f"cuda:{local_rank}"
    if device not in ("auto", "cpu"):
        raise UsageError(f"unknown device {device!r}", hint="choose auto, cpu, cuda or mps",
                         same_on_every_rank=True)
    return "gloo", "cpu"


def move_to_device(args, kwargs, device_ids):
    """The inputs moved to device_ids[0] (stock's forward does this when device_ids is set)."""
    if not device_ids:
        return args, kwargs
    import torch  # (here: choosing a backend, above, runs before torch is imported)
    from torch.utils._pytree import tree_map
    device = torch.device("cuda", device_ids[0])

    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x
    return tree_map(move, args), tree_map(move, kwargs)
