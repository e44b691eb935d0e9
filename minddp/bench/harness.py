"""The benchmarks' shared harness: the models, one timed step, rounds in a shuffled order, ranks.

    minddp bench                  # the DDP benchmark (bench/ddp.py), which uses this harness

One "step" is what a training loop does per batch: zero_grad, forward, loss, backward
(which, with a DDP wrapper, includes averaging the gradients), optimizer.step(). The
contenders are timed in one run, on the same machine, one step each per round, in a
shuffled order, so a slow minute (another process, a thermal dip) hits all of them alike.
A step's time is the slowest rank's (the job waits for it); each benchmark reports medians
over rounds, as ratios to stock's in the same run.
"""

import contextlib
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tabulate import tabulate

from ..launch.teardown import ddp_teardown
from ..run import warm
from ..run.errors import interrupted

# The collectives' names (torch 2.13 and older), and per byte passed, bytes a rank sends on a
# ring, in units of (W-1)/W.
RING = {"all_reduce": 2, "broadcast": 1, "all_gather_single": 1, "all_gather_into_tensor": 1,
        "reduce_scatter_single": 1, "reduce_scatter_tensor": 1}


def mlp(width, layers):
    """`layers` square Linear layers with ReLU between, then a 10-way head."""
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


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
        if hasattr(model, "bucket_manager"):  # picotron's DataParallelBucket: as its train.py,
            model.reset()  # zero the buckets its hooks accumulate into, after the step
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


def per_round(mine, stock):
    """Each step over stock's step of the same round (the machine's pace then the same for
    both): "median (q1-q3)" of those ratios. A range that holds 1.00x is a tie."""
    ratios = [a / b for a, b in zip(mine, stock)]
    if len(ratios) < 2:
        return f"{ratios[0]:.2f}x"
    # inclusive: the quartiles lie within the ratios seen (the default, exclusive, reaches
    # past them with few rounds: a range below 0 from 2 rounds)
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{q2:.2f}x ({q1:.2f}-{q3:.2f})"


def run_rank(rank, world_size, args, store_file, work):
    """One rank's whole benchmark, work(size, args, rank, world_size, device) per model size."""
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world_size))
    cuda = f"cuda:{rank % torch.cuda.device_count()}" if args.device == "cuda" else None
    device = torch.device(cuda or args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store_file is None:  # under torchrun
        dist.init_process_group(args.backend)
    else:
        dist.init_process_group(args.backend, init_method=f"file://{store_file}",
                                rank=rank, world_size=world_size)
    rows = []
    for size in args.sizes:
        start = time.perf_counter()
        rows += work(size, args, rank, world_size, device)
        if rank == 0:  # progress on stderr: stdout keeps the tables
            say(args, f"  {size} at {world_size} rank(s): done in"
                      f" {time.perf_counter() - start:.1f} s")
    return rows


def say(args, line):
    """One progress line on stderr, named after the benchmark that prints it."""
    print(f"{getattr(args, 'prog', 'minddp')}: {line}", file=sys.stderr, flush=True)


def _spawned(rank, world_size, args, store_file, out_file, work):
    rows = run_rank(rank, world_size, args, store_file, work)
    if rank == 0:
        torch.save(rows, out_file)
    ddp_teardown()  # the models died with bench_size()'s frames: the group is the last to go


def collect_rows(args, work):
    """Every world size's rows (rank 0's), or None on a rank other than 0 under torchrun."""
    if "WORLD_SIZE" in os.environ:  # torchrun started us: one world size, ours
        rows = run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, work)
        ddp_teardown()
        return rows if int(os.environ["RANK"]) == 0 else None
    say(args, f"{', '.join(args.sizes)} at {', '.join(map(str, args.world_sizes))} rank(s),"
              f" {args.rounds} round(s) of {args.steps} step(s) per contender: one spawn per"
              f" world size, a line here as each case is done")
    rows, start = [], time.perf_counter()
    for done, world_size in enumerate(args.world_sizes):
        if done:  # what is left, guessed from what took how long so far
            spent = time.perf_counter() - start
            left = spent / done * (len(args.world_sizes) - done)
            say(args, f"{spent:.0f} s so far; about {left:.0f} s left")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            store = os.path.join(tmp, "store")
            spawn(_spawned, (world_size, args, store, out, work), world_size)
            rows += torch.load(out, weights_only=False)
    return rows


def spawn(fn, args, nprocs):
    """mp.start_processes(fn, args, nprocs), warm (run/warm.py); Ctrl-C ends them all with
    one line."""
    # The ranks start with SIGINT ignored (the fork server starts with it so, and an ignored
    # signal stays so across exec and fork): Ctrl-C prints no traceback per rank. This
    # process ends them.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        warm.context()
        context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver",
                                     join=False)
    finally:
        signal.signal(signal.SIGINT, previous)

    def stop(signum, frame):
        for process in context.processes:
            process.kill()
        for process in context.processes:  # gone before this process ends: none outlives it
            process.join(10)  # (killed: moments; the bound only against a stuck reap)
        interrupted(signum, frame)  # one line, exit 130
    signal.signal(signal.SIGINT, stop)
    try:
        while not context.join():
            pass
    finally:
        signal.signal(signal.SIGINT, previous)


def machine(args):
    """One line: torch, backend, device, CPUs, what the figures were measured on."""
    return (f"torch {torch.__version__} | {args.backend} on {args.device} | {os.cpu_count()} CPUs"
            f" {platform.machine()} | batch {args.batch}")


def print_table(args, rows, headers, what="contender"):
    print(f"{machine(args)} | {args.rounds} rounds x {args.steps} steps per {what}")
    print(tabulate(rows, headers=headers, tablefmt=args.format, disable_numparse=True))


@contextlib.contextmanager
def counting_collectives(counts):
    """Add the bytes passed to each collective (its input; all_gather's output) to counts."""
    originals = {name: getattr(dist, name) for name in RING if hasattr(dist, name)}

    def counted(name, original):
        def call(*args, **kwargs):
            given = list(args) + [kwargs[k] for k in ("output", "input") if k in kwargs]
            # all_reduce, broadcast: the tensor; all_gather: its output; reduce_scatter: its input
            tensor = given[1] if name.startswith("reduce_scatter") else given[0]
            counts[name] = counts.get(name, 0) + tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return call
    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
