"""How long a 2-rank gloo group takes to start: spawned ranks against warm ones.

    python tests/scripts/rank_start.py [--repeat 5] [--busy 2]

"spawned": multiprocessing's spawn, each rank a fresh interpreter that imports torch (how the
tests' and the grader's ranks started before minddp/run/warm.py). "warm": forked from the
fork server of run/warm.py, which imported torch and minddp once (started before the first
timed group, as in a test session after its first spawn). Timed per group, from the first
Process.start() to both ranks past init_process_group and a barrier ("joined"), and to both
processes gone ("ended"). --busy N runs N busy loops beside it (a loaded machine). Prints the
median and the range of --repeat groups of each way, the ways alternating.
"""

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def _rank(rank, store, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dist.barrier()
    Path(out, f"joined{rank}").write_text(str(time.monotonic()))
    dist.destroy_process_group()


def _busy():
    while True:
        pass


def one_group(context):
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        procs = [context.Process(target=_rank, args=(r, os.path.join(tmp, "store"), tmp))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        ended = time.monotonic() - t0
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        joined = max(float(Path(tmp, f"joined{r}").read_text()) for r in range(2)) - t0
    return joined, ended


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0)
    args = parser.parse_args()
    from minddp.run import warm
    ways = {"spawned": multiprocessing.get_context("spawn"), "warm": warm.context(start=True)}
    one_group(ways["warm"])  # the server's own start and imports: once per session, untimed
    busy = [multiprocessing.get_context("fork").Process(target=_busy, daemon=True)
            for _ in range(args.busy)]
    for b in busy:
        b.start()
    times = {way: [] for way in ways}
    try:
        for _ in range(args.repeat):
            for way, context in ways.items():
                times[way].append(one_group(context))
    finally:
        for b in busy:
            b.kill()
    print(f"2-rank gloo group, {args.repeat} groups per way, {args.busy} busy loop(s) beside,"
          f" {os.cpu_count()} CPUs")
    for way, got in times.items():
        for i, what in enumerate(("joined", "ended")):
            values = [g[i] for g in got]
            print(f"  {way:8s} {what}: median {statistics.median(values):.2f} s"
                  f" ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
