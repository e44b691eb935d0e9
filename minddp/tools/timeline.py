"""Recording a timeline from outside: when backward computes and when each bucket's all-reduce runs.

    torchrun --nproc_per_node=2 examples/manual_ddp.py --timeline runs/lesson.json
    minddp timeline --size 17M --world-size 2       # naive, bucketed, stock (bench/timeline.py)

Buckets exist so that communication runs while backward still computes. Recording (off
unless asked for) notes, per step and rank: when backward starts, when each gradient
arrives, when each bucket's all-reduce is launched and when it completes (a callback on
its future, run when the backend finishes it, not when someone waits), where backward is
*blocked* waiting (NaiveDDP's blocking calls, the wait at the end of backward), and the
optimizer step. Stock DDP is timed through a comm hook that only wraps PyTorch's own
allreduce_hook. One clock for all ranks of a machine (time.perf_counter: CLOCK_MONOTONIC).
The output is a Chrome trace (Perfetto, chrome://tracing); overlap.py reads it.
"""

import contextlib
import json
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..ddp.bucketed import BucketedDDP
from ..launch.usage_error import UsageError
from ..ddp.naive import NaiveDDP
from .overlap import COMM, COMPUTE


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
