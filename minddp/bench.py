"""Benchmark: step time of no sync, naive and bucketed ManualDDP, and stock DDP, side by side.

    python -m minddp.bench                                   # 1 and 2 gloo ranks, started here
    python -m minddp.bench --world-sizes 2 --sizes 0.3M 4M   # a subset
    torchrun --nproc_per_node=2 -m minddp.bench               # under torchrun: its world size
    python -m minddp.bench --device cuda --backend nccl --world-sizes 1

One "step" is what a training loop does per batch: zero_grad, forward, loss, backward
(which, with a DDP wrapper, includes averaging the gradients), optimizer.step(). The
contenders are timed in one run, on the same machine, one step each per round, in a
shuffled order, so a slow minute (another process, a thermal dip) hits all of them alike.
A step's time is the slowest rank's (the job waits for it); each contender's figure is the
median over its timed steps, reported as a ratio to stock DDP's median: below 1.00x is faster;
"view" and "fp16" rows also as a ratio to stock with the same setting.
"""

import argparse
import copy
import os
import platform
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.parallel import DistributedDataParallel as DDP

from .ddp import ManualDDP
from .launch import ddp_teardown
from .hooks import fp16_mean_hook
from .naive import NaiveDDP
from .workarounds import import_dynamo_first

SIZES = {"0.3M": (256, 4), "4M": (1024, 4), "17M": (2048, 4)}  # name: (width, layers)
CONTENDERS = ["no sync", "naive", "bucketed", "stock", "bucketed view", "stock view",
              "bucketed fp16", "stock fp16"]


def mlp(width, layers):
    """`layers` square Linear layers with ReLU between, then a 10-way head."""
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def wrap(contender, module, device):
    """The contender's model. "view": gradient_as_bucket_view=True; "fp16": fp16_mean_hook."""
    if contender == "no sync":
        return module  # each rank trains alone: the compute-only floor
    if contender == "naive":
        return NaiveDDP(module)
    view = contender.endswith(" view")
    if contender.startswith("bucketed"):
        model = ManualDDP(module, gradient_as_bucket_view=view)
    else:
        model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=view)
    if contender.endswith(" fp16"):
        model.register_comm_hook(None, fp16_mean_hook)
    return model


def grad_memory_mb(contender, model):
    """MB held by .grad tensors and gradient buckets together, after a step (distinct storages)."""
    storages = {}
    for p in model.parameters():
        if p.grad is not None:
            s = p.grad.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    if contender.startswith("bucketed"):
        for b in model.buckets:
            s = b.flat.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    elif contender.startswith("stock") and not contender.endswith(" view"):
        # Stock's buckets live in C++; the reducer hands out zero tensors of their shapes.
        for i, b in enumerate(model.reducer._get_zeros_like_grad_buckets()):
            storages[("stock bucket", i)] = b.buffer().numel() * b.buffer().element_size()
    return sum(storages.values()) / 2**20


def all_reduce_calls(contender, model, world_size):
    if world_size == 1 or contender == "no sync":
        return 0
    if contender == "naive":
        return sum(p.requires_grad for p in model.parameters())
    if contender.startswith("bucketed"):
        return len(model.buckets)
    # Stock's reducer keeps its buckets in C++; its layout equals ManualDDP's bucketed
    # one (tests/test_buckets.py checks it through a comm hook), so its count is the same.
    return None


def time_steps(model, optimizer, batches, device, world_size):
    """Seconds per step for each batch, on this rank."""
    times = []
    for x, y in batches:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world_size > 1:
            # Start every step together: otherwise a rank that finished early waits
            # inside the next step's all_reduce, and that wait lands on another contender.
            dist.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU runs behind the Python that launches it
        times.append(time.perf_counter() - t0)
    return times


def timed_rounds(contenders, batches, rounds, device, world_size):
    """{name: seconds per step} over `rounds` rounds; contenders: {name: (model, optimizer)}."""
    samples = {c: [] for c in contenders}
    for r in range(rounds):
        # A fresh order each round (the same on every rank: same seed): each contender
        # runs first, last, and after each of the others alike. A fixed rotation would
        # always put the same contender after the naive one and its ten small collectives.
        for c in random.Random(r).sample(list(contenders), len(contenders)):
            times = torch.tensor(time_steps(*contenders[c], batches, device, world_size))
            if world_size > 1:
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            samples[c] += times.tolist()
    return samples


def bench_size(size, args, rank, world_size, device):
    width, layers = SIZES[size]
    torch.manual_seed(0)
    base = mlp(width, layers).to(device)
    contenders = args.contenders
    models = {c: wrap(c, copy.deepcopy(base), device) for c in contenders}  # same start for all
    optimizers = {c: torch.optim.SGD(m.parameters(), lr=1e-3) for c, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, width, generator=g).to(device),
                torch.randint(0, 10, (args.batch,), generator=g).to(device))
               for _ in range(args.steps)]
    for c in contenders:  # warm-up: allocations, and the buckets' rebuild after step one
        time_steps(models[c], optimizers[c], batches[:args.warmup], device, world_size)
    samples = timed_rounds({c: (models[c], optimizers[c]) for c in contenders}, batches,
                           args.rounds, device, world_size)
    params = sum(p.numel() for p in base.parameters())
    grad_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
    stock = statistics.median(samples["stock"])
    rows = []
    for c in contenders:
        median = statistics.median(samples[c])
        synced = world_size > 1 and c != "no sync"
        sent = grad_mb / 2 if c.endswith(" fp16") else grad_mb  # float16 on the wire
        calls = all_reduce_calls(c, models[c], world_size)
        knob = c.split(" ", 1)[1] if c.startswith(("bucketed ", "stock ")) else None
        twin = f"stock {knob}" if knob else None  # stock DDP with the same setting
        same = f"{median / statistics.median(samples[twin]):.2f}x" if twin in samples else ""
        rows.append([world_size, size, f"{params / 1e6:.2f}M", c, f"{median * 1e3:.2f}",
                     f"{median / stock:.2f}x", same, f"{sent if synced else 0:.1f}",
                     "=bucketed" if calls is None else calls,
                     f"{grad_memory_mb(c, models[c]):.1f}"])
    return rows


def run_rank(rank, world_size, args, store_file=None, work=None):
    """One rank's whole benchmark, work(size, args, rank, world_size, device) per model size."""
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world_size))
    cuda = f"cuda:{rank % torch.cuda.device_count()}" if args.device == "cuda" else None
    device = torch.device(cuda or args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import_dynamo_first()  # before the group: see launch.py
    if store_file is None:  # under torchrun
        dist.init_process_group(args.backend)
    else:
        dist.init_process_group(args.backend, init_method=f"file://{store_file}",
                                rank=rank, world_size=world_size)
    work = work or bench_size
    return [row for size in args.sizes for row in work(size, args, rank, world_size, device)]


def _spawned(rank, world_size, args, store_file, out_file, work):
    rows = run_rank(rank, world_size, args, store_file, work)
    if rank == 0:
        torch.save(rows, out_file)
    ddp_teardown()  # the models died with bench_size()'s frames: the group is the last to go


HEADERS = ["ranks", "model", "params", "contender", "median ms/step", "vs stock",
           "vs stock, same knob",
           "MB all-reduced/step", "all_reduce calls/step", "MB grads+buckets"]


def common_parser(doc, default_world_sizes):
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=default_world_sizes,
                        help="started here, one after another (ignored under torchrun)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=64, help="rows per step and rank")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of alternating contenders")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--format", default="simple", help="tabulate format, e.g. github for docs")
    return parser


def collect_rows(args, work):
    """Every world size's rows (rank 0's), or None on a rank other than 0 under torchrun."""
    if "WORLD_SIZE" in os.environ:  # torchrun started us: one world size, ours
        rows = run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, work=work)
        ddp_teardown()
        return rows if int(os.environ["RANK"]) == 0 else None
    rows = []
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            store = os.path.join(tmp, "store")
            mp.start_processes(_spawned, args=(world_size, args, store, out, work),
                               nprocs=world_size, start_method="spawn")
            rows += torch.load(out, weights_only=False)
    return rows


def machine(args):
    """One line: torch, backend, device, CPUs, what the figures were measured on."""
    return (f"torch {torch.__version__} | {args.backend} on {args.device} | {os.cpu_count()} CPUs"
            f" {platform.machine()} | batch {args.batch}")


def print_table(args, rows, headers, what="contender"):
    print(f"{machine(args)} | {args.rounds} rounds x {args.steps} steps per {what}")
    print(tabulate(rows, headers=headers, tablefmt=args.format, disable_numparse=True))


def main():
    parser = common_parser(__doc__, [1, 2])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS,
                        help="view: gradient_as_bucket_view=True;"
                             " fp16: minddp.hooks.fp16_mean_hook")
    args = parser.parse_args()
    rows = collect_rows(args, bench_size)
    if rows is not None:
        print_table(args, rows, HEADERS)


if __name__ == "__main__":
    main()
