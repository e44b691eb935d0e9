"""See the overlap: when backward computes and when each bucket's all-reduce runs, per rank.

    minddp timeline --size 17M --world-size 2             # naive, bucketed, stock
    minddp timeline --ddp bucketed --out runs/timeline.json
    minddp timeline --size 17M --world-size 2 --png runs/timeline.png
    minddp timeline --trace runs/lesson.json --png runs/lesson.png   # an example's --timeline

Starts the ranks here (gloo, CPU), trains the benchmark's MLP a few steps under each DDP,
records them with tools/timeline.py, and prints a text picture of the last step with the
overlap figure: the share of communication time that ran while backward was computing,
not blocked. --png draws the same step (tools/pictures.py).
"""

from . import SIZES, check_outputs
from ..run.cli import ArgumentParser


def parse(argv=None):
    """The flags, checked before torch is imported: a mistyped one costs a moment."""
    parser = ArgumentParser(prog="minddp timeline", description=__doc__.split("\n\n")[0])
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
    from ..launch.usage_error import UsageError
    from ..run.errors import exit_on_usage_error
    check_outputs(args, "png", "out")
    with exit_on_usage_error():
        if not args.trace and (args.steps < 2 or args.world_size < 1):
            raise UsageError("--steps must be 2 or more and --world-size 1 or more",
                             hint="e.g. --steps 4 --world-size 2")
    return args


if __name__ == "__main__":
    ARGS = parse()


import os  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ..ddp.bucketed import BucketedDDP  # noqa: E402
from ..launch.teardown import ddp_teardown  # noqa: E402
from ..ddp.naive import NaiveDDP  # noqa: E402
from ..run.errors import exit_on_usage_error  # noqa: E402
from ..tools.overlap import overlap, text_timeline  # noqa: E402
from ..tools.pictures import draw_timeline  # noqa: E402
from ..tools.timeline import (read_chrome_trace, record_timeline,  # noqa: E402,F401
                              write_chrome_trace)
from .harness import mlp, spawn  # noqa: E402


def _run_rank(rank, world_size, args, store_file, out_file):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
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


def main(args):
    if args.trace:
        with exit_on_usage_error():
            return _draw_trace(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        spawn(_run_rank, (args.world_size, args, os.path.join(tmp, "store"), out), args.world_size)
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
    raise SystemExit(main(ARGS))
