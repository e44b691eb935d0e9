"""See the overlap: when backward computes and when each bucket's all-reduce runs, per rank.

    python -m minddp.timeline --size 17M --world-size 2             # naive, bucketed, stock
    python -m minddp.timeline --ddp bucketed --out runs/timeline.json
    python -m minddp.timeline --size 17M --world-size 2 --png runs/timeline.png
    torchrun --nproc_per_node=2 examples/manual_ddp.py --timeline runs/lesson.json

Buckets exist so that communication runs while backward still computes. Recording (off
unless asked for) notes, per step and rank: when backward starts, when each gradient
arrives, when each bucket's all-reduce is launched and when it completes (a callback on
its future, run when the backend finishes it, not when someone waits), where backward is
*blocked* waiting (NaiveDDP's blocking calls, the wait at the end of backward), and the
optimizer step. Stock DDP is timed through a comm hook that only wraps PyTorch's own
allreduce_hook. One clock for all ranks of a machine (time.perf_counter: CLOCK_MONOTONIC).

The output: a Chrome trace (Perfetto, chrome://tracing), a text timeline of one step, and
the overlap figure: the share of communication time that ran while backward was
computing, not blocked.
"""

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .bench import SIZES, mlp
from .cli import check_output_path
from .bucketed import BucketedDDP
from .errors import UsageError, exit_on_usage_error
from .launch import ddp_teardown
from .naive import NaiveDDP
from .overlap import COMM, COMPUTE, overlap, text_timeline
from .pictures import draw_timeline, require_matplotlib
from .workarounds import import_dynamo_first


def now_us():
    return time.perf_counter_ns() / 1000  # CLOCK_MONOTONIC on Linux: shared by the ranks


class Timeline:
    """Events of one rank: (step, track, name, start us, duration us, args)."""

    def __init__(self, path=None):
        self.path, self.events, self.step = path, [], 0

    now = staticmethod(now_us)

    def add(self, track, name, start, end, **args):
        self.events.append({"step": self.step, "track": track, "name": name, "ts": start,
                            "dur": max(end - start, 0.0), "args": args})

    @contextlib.contextmanager
    def span(self, track, name, **args):
        start = now_us()
        try:
            yield
        finally:
            self.add(track, name, start, now_us(), **args)

    def comm(self, name, nbytes, work):
        """An async collective: launched now, done when its future completes."""
        start, step = now_us(), self.step
        future = work.get_future() if hasattr(work, "get_future") else work

        def done(_):  # runs in the backend's thread, the moment the collective completes
            self.events.append({"step": step, "track": COMM, "name": name, "ts": start,
                                "dur": now_us() - start, "args": {"bytes": nbytes}})
        future.then(done)

    def save(self):
        """Collective: call on every rank. Rank 0 writes every rank's events to the path."""
        if self.path is None:
            return None
        everyone = [None] * dist.get_world_size()
        dist.barrier()  # every collective of the run has completed, its callback too
        dist.all_gather_object(everyone, self.events)
        if dist.get_rank() == 0:
            write_chrome_trace(self.path, everyone)
            print(f"timeline: {self.path} (open it in Perfetto or chrome://tracing)", flush=True)
        return everyone


def record_timeline(model, optimizer, path):
    """Record `model`'s steps into a Timeline (nothing at all when path is None).

    Everything is recorded from outside the wrapper, so the lecture classes carry no
    recording code and the numbers cannot change: autograd hooks registered after the
    wrapper's own run right after them, and read what the wrapper left behind (a bucket's
    `work` in flight); stock DDP's buckets, which live in C++, through a comm hook.
    """
    timeline = Timeline(path)
    if path is None:
        return timeline
    module = getattr(model, "module", model)
    naive, bucketed = isinstance(model, NaiveDDP), isinstance(model, BucketedDDP)
    backward = {"works": [], "comms": 0, "last": None}  # this backward so far
    if not naive and not bucketed:  # stock DDP: time PyTorch's own allreduce_hook
        model.register_comm_hook(backward, _timed_allreduce_hook(timeline))
    names = {p: n for n, p in module.named_parameters() if p.requires_grad}
    index = {p: i for i, p in enumerate(names)}
    # The hooks below live on the parameters, which the wrapper outlives only if nothing
    # they hold points back at it: stock DDP's C++ reducer would close a cycle that the
    # garbage collector cannot see through, keeping the process group alive past teardown.
    wrapper = weakref.ref(model)
    computed = {}  # parameter -> when autograd handed its gradient over (naive: comm start)

    def end_of_backward():  # queued after the wrapper's own: runs once its waiting is done
        if backward["comms"]:
            timeline.add(COMPUTE, "blocked: wait for buckets", backward["last"], now_us(),
                         blocked=True)
        backward.update(works=[], comms=0, last=None)

    def after_wrapper(p):  # the wrapper's hook on p has run (NaiveDDP's blocking all_reduce)
        t, model = now_us(), wrapper()
        if backward["last"] is None:
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)
        if naive and model._sync_this_backward and model.world_size > 1:
            timeline.add(COMM, f"param {index[p]}", computed[p], t,
                         bytes=p.numel() * p.element_size(), parameter=names[p])
            timeline.add(COMPUTE, "blocked: all_reduce", computed[p], t, blocked=True)
            backward["comms"] += 1
        for position, bucket in enumerate(model.buckets if bucketed else []):
            if bucket.work is not None and not any(w is bucket.work for w in backward["works"]):
                backward["works"].append(bucket.work)  # launched by the hook that just ran
                timeline.comm(f"bucket {position}", bucket.nbytes(), bucket.work)
                backward["comms"] += 1
        timeline.add(COMPUTE, f"grad {names[p]}", t, t)
        backward["last"] = now_us()

    for p in names:
        p.register_hook(lambda grad, p=p: computed.update({p: now_us()}))  # before accumulating
        p.register_post_accumulate_grad_hook(after_wrapper)

    def backward_starts(_module, _inputs, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(
                lambda g: timeline.add(COMPUTE, "backward starts", now_us(), now_us()))
    model.register_forward_hook(backward_starts)
    starts = {}
    optimizer.register_step_pre_hook(lambda *_: starts.update(t=now_us()))

    def step_done(*_):
        timeline.add(COMPUTE, "optimizer step", starts["t"], now_us())
        timeline.step += 1
    optimizer.register_step_post_hook(step_done)
    return timeline


def _timed_allreduce_hook(timeline):
    def timed_allreduce_hook(backward, bucket):
        future = default_hooks.allreduce_hook(None, bucket)  # stock's own path, unchanged
        buffer = bucket.buffer()
        timeline.comm(f"bucket {bucket.index()}", buffer.numel() * buffer.element_size(), future)
        backward["comms"] += 1
        return future
    return timed_allreduce_hook


def write_chrome_trace(path, everyone):
    """Chrome trace-event JSON: a process per rank, a thread per track, 'X' events."""
    tracks = {COMPUTE: 0, COMM: 1}
    events = []
    for rank, evs in enumerate(everyone):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        for track, tid in tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": track}})
        for e in evs:
            events.append({"name": e["name"], "ph": "X" if e["dur"] > 0 else "i", "pid": rank,
                           "tid": tracks[e["track"]], "ts": e["ts"], "dur": e["dur"], "s": "t",
                           "args": {**e["args"], "step": e["step"]}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _run_rank(rank, world_size, args, store_file, out_file):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    import_dynamo_first()
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    results = {}
    for kind in args.kinds:
        torch.manual_seed(0)
        width, layers = SIZES[args.size]
        model = mlp(width, layers)
        if kind == "naive":
            model = NaiveDDP(model)
        elif kind == "bucketed":
            model = BucketedDDP(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        path = _out_path(args.out, kind, args.kinds) or "unused"  # recorded, written if --out
        timeline = record_timeline(model, optimizer, path)
        g = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            x, y = torch.randn(64, width, generator=g), torch.randint(0, 10, (64,), generator=g)
            dist.barrier()  # steps start together: the picture shows one step, not drift
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        everyone = timeline.save() if args.out else _gather(timeline)
        last = args.steps - 1  # the first steps differ: one bucket, then rebuilt
        results[kind] = (text_timeline(everyone, last),
                         [overlap(evs, last) for evs in everyone], everyone)
        del model, optimizer
    if rank == 0:
        torch.save(results, out_file)
    ddp_teardown()


def _gather(timeline):
    everyone = [None] * dist.get_world_size()
    dist.barrier()
    dist.all_gather_object(everyone, timeline.events)
    return everyone


def _out_path(out, kind, kinds):
    if out is None or len(kinds) == 1:
        return out
    root, ext = os.path.splitext(out)
    return f"{root}-{kind}{ext or '.json'}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minddp.timeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="17M", choices=list(SIZES), help="the benchmark's MLP")
    parser.add_argument("--world-size", type=int, default=2, help="ranks, started here (gloo, CPU)")
    parser.add_argument("--ddp", default="all", choices=["naive", "bucketed", "stock", "all"])
    parser.add_argument("--steps", type=int, default=4, help="steps; the last one is drawn")
    parser.add_argument("--out", metavar="PATH",
                        help="Chrome trace JSON (with --ddp all: PATH-naive.json, ...)")
    parser.add_argument("--png", metavar="PATH", help="draw the last step to a PNG (matplotlib)")
    parser.add_argument("--trace", metavar="PATH",
                        help="draw a recorded trace (--timeline's, --out's) instead of running")
    args = parser.parse_args(argv)
    args.kinds = ["naive", "bucketed", "stock"] if args.ddp == "all" else [args.ddp]
    with exit_on_usage_error():
        if args.png:
            require_matplotlib()
            check_output_path(args.png, "--png")
        if args.out:
            check_output_path(args.out, "--out")
        if args.trace:
            return _draw_trace(args)
        if args.steps < 2 or args.world_size < 1:
            raise UsageError("--steps must be 2 or more and --world-size 1 or more",
                             hint="e.g. --steps 4 --world-size 2")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.start_processes(_run_rank, args=(args.world_size, args, os.path.join(tmp, "store"), out),
                           nprocs=args.world_size, start_method="spawn")
        results = torch.load(out, weights_only=False)
    print(f"torch {torch.__version__} | {args.size} MLP | {args.world_size} gloo rank(s) |"
          f" {os.cpu_count()} CPUs | = backward computing, B blocked, O optimizer step,"
          f" digits: buckets")
    panels = []
    for kind, (text, overlaps, everyone) in results.items():
        shares = _shares(overlaps)
        print(f"\n{kind}: communication overlapped with backward: {shares} (per rank)")
        if args.world_size == 1:
            print("(world size 1: nothing to communicate, nothing to draw on the comm rows)")
        print(text)  # (with --out, each rank 0 said where its trace went, above)
        panels.append((f"{kind}: communication overlapped with backward {shares} (per rank)",
                       everyone, args.steps - 1))
    if args.png:
        draw_timeline(panels, args.png, f"{args.size} MLP | {args.world_size} gloo rank(s) |"
                                        f" {_machine()}")
        print(f"picture: {args.png}")
    return 0


def _shares(overlaps):
    return ", ".join("n/a" if o is None else f"{100 * o:.0f}%" for o in overlaps)


def _machine():
    return f"torch {torch.__version__} | {os.cpu_count()} CPUs {platform.machine()}"


def read_chrome_trace(path):
    """Events per rank, as recorded, from a trace write_chrome_trace() wrote."""
    try:
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read {path} as a minddp trace ({type(e).__name__})",
                         hint="give a file written by --timeline or --out") from None
    tracks = {0: COMPUTE, 1: COMM}
    everyone = [[] for _ in range(1 + max(e["pid"] for e in trace))]
    for e in trace:
        if e["ph"] != "M":
            args = dict(e["args"])
            everyone[e["pid"]].append({"step": args.pop("step"), "track": tracks[e["tid"]],
                                       "name": e["name"], "ts": e["ts"], "dur": e["dur"],
                                       "args": args})
    return everyone


def _draw_trace(args):
    everyone = read_chrome_trace(args.trace)
    last = max(e["step"] for evs in everyone for e in evs)
    shares = _shares([overlap(evs, last) for evs in everyone])
    print(f"{args.trace}: step {last}, communication overlapped with backward: {shares}")
    print(text_timeline(everyone, last))
    if args.png:
        draw_timeline([(f"{os.path.basename(args.trace)}: step {last}, overlapped {shares}",
                        everyone, last)], args.png, _machine())
        print(f"picture: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
