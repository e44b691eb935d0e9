"""The pipeline's bubble, measured: each stage's idle share per schedule, beside the formula.

    minddp pp-bench                                  # 2 and 4 stages, 4 and 8 microbatches
    minddp pp-bench --world-sizes 2 --sizes 4M --microbatches 4 --png runs/pp-bubble.png

Eight square Linear layers of the --sizes width (4M: 1024), ReLU after each, cut into one
stage per rank (pp.stage_layers: equal stages at 2 and 4), GPipe and 1F1B, as minddp.pp and
as stock's torch.distributed.pipelining, in rotating rounds. Per stage, from the recorded
intervals of the last round:

  busy       forward and backward compute (minddp: forward_one and backward_one, less the
             time spent waiting in recv; stock: forward_one_chunk and backward_one_chunk,
             which its schedule calls once the recv has finished)
  idle       1 - busy / step: the bubble, and the waits on sends and receives
  formula    (p - 1) / (m + p - 1): the bubble with equal stages and free communication
  alive      the most microbatches whose forward is done and backward not yet, from the
             order run (GPipe: m; 1F1B: min(m, p - s)); activations MB = alive x the bytes
             autograd saves for one microbatch's forward on this stage (measured)

Step time: the median over rounds, as a ratio to stock GPipe's in the same run.
"""

from . import bench_parser, check_outputs


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp pp-bench", [2, 4])
    parser.set_defaults(sizes=["4M"], rounds=10, batch=64)
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 8], metavar="M")
    parser.add_argument("--png", metavar="PATH",
                        help="draw each stage's forwards, backwards and waits, GPipe beside 1F1B"
                             " (matplotlib; the first world size, size and --microbatches)")
    return check_outputs(parser.parse_args(argv), "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import copy  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed import pipelining as stock_pp  # noqa: E402

from .. import pp  # noqa: E402
from . import SIZES  # noqa: E402
from .harness import collect_rows, machine, print_table  # noqa: E402

WAYS = [("minddp", "gpipe"), ("minddp", "1f1b"), ("stock", "gpipe"), ("stock", "1f1b")]


class Recorder:
    """(kind, microbatch, start s, end s) of each forward, backward and recv on this rank."""

    def __init__(self):
        self.events = []

    def wrap(self, obj, name, kind):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                i = args[0] if args and isinstance(args[0], int) else -1
                self.events.append((kind, i, start, time.perf_counter()))
        setattr(obj, name, timed)


def build(way, layers, rank, world_size, m, device):
    impl, schedule = way
    module = copy.deepcopy(layers)
    lib = pp if impl == "minddp" else stock_pp
    stage = lib.PipelineStage(module, rank, world_size, device)
    recorder = Recorder()
    if impl == "minddp":
        recorder.wrap(stage, "forward_one", "F")
        recorder.wrap(stage, "backward_one", "B")
        recorder.wrap(stage, "recv", "recv")
    else:
        recorder.wrap(stage, "forward_one_chunk", "F")
        recorder.wrap(stage, "backward_one_chunk", "B")
    runner = {"gpipe": lib.ScheduleGPipe, "1f1b": lib.Schedule1F1B}[schedule](
        stage, m, loss_fn=F.cross_entropy)
    return runner, torch.optim.SGD(module.parameters(), lr=1e-3), recorder


def one_step(runner, optimizer, x, y, rank, world_size):
    optimizer.zero_grad()
    dist.barrier()  # every stage starts the step together
    start = time.perf_counter()
    if rank == 0:
        runner.step(x)
    elif rank == world_size - 1:
        runner.step(target=y)
    else:
        runner.step()
    optimizer.step()
    return start, time.perf_counter()


def stage_shares(events, start, end):
    """(busy s, idle share, most microbatches alive) of one stage in one step."""
    inside = [e for e in events if start <= e[2] < end]
    busy = sum(e[3] - e[2] for e in inside if e[0] in "FB")
    busy -= sum(e[3] - e[2] for e in inside if e[0] == "recv")  # waiting, inside a forward
    alive = most = 0
    for kind, *_ in sorted((e for e in inside if e[0] in "FB"), key=lambda e: e[2]):
        alive += 1 if kind == "F" else -1
        most = max(most, alive)
    return busy, 1 - busy / (end - start), most


def saved_bytes(layers, x_shape):
    """Bytes autograd saves for one microbatch's forward through `layers`."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    x = torch.randn(*x_shape, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layers(x)
    return total[0]


def pp_size(size, args, rank, world_size, device):
    width = SIZES[size][0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8)
                                  for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    layers = pp.stage_layers(model, rank, world_size).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, width, generator=g).to(device)
    y = torch.randint(0, width, (args.batch,), generator=g).to(device)  # width classes
    rows = []
    for m in args.microbatches:
        built = {way: build(way, layers, rank, world_size, m, device) for way in WAYS}
        for way, (runner, optimizer, _) in built.items():
            for _ in range(args.warmup):
                one_step(runner, optimizer, x, y, rank, world_size)
        times, last = {way: [] for way in WAYS}, {}
        for r in range(args.rounds):
            order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]  # each way first in turn
            for way in order:
                last[way] = one_step(*built[way][:2], x, y, rank, world_size)
                times[way].append(last[way][1] - last[way][0])
        per_microbatch = saved_bytes(layers, (args.batch // m, width))
        mine = {}
        for way in WAYS:
            busy, idle, alive = stage_shares(built[way][2].events, *last[way])
            mine[way] = [idle, alive, alive * per_microbatch / 2**20,
                         statistics.median(times[way])]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (mine, [e for way in WAYS[:2] for e in
                                                 _events_of(built[way][2], last[way], way)]))
        stock = max(r[0][("stock", "gpipe")][3] for r in everyone)
        for way in WAYS:  # (model: the width's name)
            step = max(r[0][way][3] for r in everyone)  # the slowest stage sets the pace
            rows.append({"ranks": world_size, "model": size, "m": m, "way": f"{way[0]} {way[1]}",
                         "idle": [r[0][way][0] for r in everyone],
                         "formula": (world_size - 1) / (m + world_size - 1),
                         "alive": [r[0][way][1] for r in everyone],
                         "activations MB": [r[0][way][2] for r in everyone],
                         "ms": step * 1e3, "vs stock": step / stock,
                         "events": [r[1] for r in everyone] if way[0] == "minddp" else None})
    return rows


def _events_of(recorder, span, way):
    start, end = span
    return [(way[1], kind, i, s - start, e - start) for kind, i, s, e in recorder.events
            if start <= s < end]


HEADERS = ["stages", "model", "m", "way", "idle per stage", "formula", "alive per stage",
           "activations MB per stage", "median ms/step", "vs stock gpipe"]


def table_row(r):
    return [r["ranks"], r["model"], r["m"], r["way"],
            " ".join(f"{v:.0%}" for v in r["idle"]), f"{r['formula']:.0%}",
            " ".join(map(str, r["alive"])), " ".join(f"{v:.1f}" for v in r["activations MB"]),
            f"{r['ms']:.2f}", f"{r['vs stock']:.2f}x"]


def main(args):
    rows = collect_rows(args, pp_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print_table(args, [table_row(r) for r in rows], HEADERS, what="way")
    if args.png:
        from ..tools.bubble import draw_pipeline
        first = [r for r in rows if r["events"] and r["ranks"] == rows[0]["ranks"]
                 and r["model"] == rows[0]["model"] and r["m"] == rows[0]["m"]]
        draw_pipeline(first, args.png, machine(args))
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main(ARGS)
