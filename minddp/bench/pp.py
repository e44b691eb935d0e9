"""The pipeline's bubble, measured: each rank's idle share per schedule, beside the formula.

    minddp pp-bench                                  # 2 and 4 ranks, 4 and 8 microbatches
    minddp pp-bench --world-sizes 2 --microbatches 4 --schedules GPipe 1F1B --png runs/b.png

Eight square Linear layers of the --sizes width (4M: 1024), ReLU after each, cut by
pp.stage_layers into one stage per rank (GPipe, 1F1B) or two (the others: a loop, or a V for
ZBVZeroBubble and DualPipeV), each --schedules as minddp.pp and as stock's
torch.distributed.pipelining, in rotating rounds. Per rank, from the recorded intervals of
the last round:

  busy       compute: every F, B, I and W (minddp: the schedule's forward and backward,
             less the time spent waiting in recv; stock: its stages' forward_one_chunk,
             backward_one_chunk and backward_weight_one_chunk, which its schedule calls
             once the recv has finished)
  idle       1 - busy / step: the bubble, and the waits on sends and receives
  formula    (p-1)/(m+p-1), with v stages per rank (p-1)/(v*m+p-1); none for zero bubble
  laid out   the bubble of the rank's lists run with equal stages and free communication
             (tools/pipeline_slots.py; equal to the formula where there is one)
  alive      the most (stage, microbatch) activations kept at once: +1 at F, -1 at B or W;
             MB = alive x the bytes autograd saves for one microbatch on one stage (measured)

Step time: the median over rounds of the slowest rank, as ratios: to stock GPipe's, and
minddp's to stock's same schedule, in the same run. DualPipeV runs where m >= 2p only.
"""

from . import bench_parser, check_outputs


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV"]
ONE_STAGE, V_SHAPED = ("GPipe", "1F1B"), ("ZBVZeroBubble", "DualPipeV")


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp pp-bench", [2, 4])
    parser.set_defaults(sizes=["4M"], rounds=10, batch=64)
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 8], metavar="M")
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES,
                        metavar="NAME", help=f"stock's names without Schedule: {SCHEDULES}")
    parser.add_argument("--png", metavar="PATH",
                        help="draw each rank's actions and waits, a panel per schedule, minddp's"
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
from .harness import collect_rows, machine, per_round, print_table  # noqa: E402

from ..pp.interleaved import loop_placement  # noqa: E402
from ..pp.v_shaped import v_placement  # noqa: E402
from ..run import older_torch  # noqa: E402,F401  (torch 2.11, 2.12: stock's stages as 2.13's)
from ..tools.pipeline_slots import figures, schedules  # noqa: E402


class Recorder:
    """(stage, kind, microbatch, start s, end s) of each F, B, I, W and recv on this rank."""

    def __init__(self):
        self.events = []

    def wrap(self, obj, name, what):
        """Time obj.name(*args); what(args, kwargs) says (stage, kind, microbatch)."""
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.events.append((*what(args, kwargs), start, time.perf_counter()))
        setattr(obj, name, timed)


def stages_per_rank(name):
    return 1 if name in ONE_STAGE else 2


def build(way, model, rank, world_size, m, device):
    """The runner of one way (impl, schedule) on this rank, its optimizer and its recorder."""
    impl, name = way
    num_stages = stages_per_rank(name) * world_size
    place = v_placement if name in V_SHAPED else loop_placement
    mine = [s for s in range(num_stages) if place(s, world_size) == rank]
    modules = [copy.deepcopy(pp.stage_layers(model, s, num_stages)).to(device) for s in mine]
    lib = pp if impl == "minddp" else stock_pp
    stages = [lib.PipelineStage(mod, s, num_stages, device) for mod, s in zip(modules, mine)]
    runner = getattr(lib, f"Schedule{name}")(stages if len(stages) > 1 else stages[0], m,
                                             loss_fn=F.cross_entropy)
    recorder = Recorder()
    if impl == "minddp":  # its two hooks: forward(stage, i, x), backward(stage, kind, i, loss)
        recorder.wrap(runner, "forward", lambda a, k: (a[0].index, "F", a[1]))
        recorder.wrap(runner, "backward", lambda a, k: (a[0].index, a[1], a[2]))
        for stage in stages:
            recorder.wrap(stage, "recv", lambda a, k: (-1, "recv", -1))
    else:
        for stage in stages:
            s = stage.stage_index
            recorder.wrap(stage, "forward_one_chunk", lambda a, k, s=s: (s, "F", a[0]))
            recorder.wrap(stage, "backward_one_chunk", lambda a, k, s=s: (
                s, "B" if k.get("full_backward", True) else "I", a[0]))
            recorder.wrap(stage, "backward_weight_one_chunk", lambda a, k, s=s: (s, "W", a[0]))
    params = [p for mod in modules for p in mod.parameters()]
    return runner, torch.optim.SGD(params, lr=1e-3), recorder, (0 in mine, num_stages - 1 in
                                                               mine), modules[0]


def one_step(runner, optimizer, x, y, ends):
    first, last = ends  # does this rank hold the first stage, the last?
    optimizer.zero_grad()
    dist.barrier()  # every rank starts the step together
    start = time.perf_counter()
    runner.step(*([x] if first else []), target=y if last else None)
    optimizer.step()
    return start, time.perf_counter()


def stage_shares(events, start, end):
    """(busy s, idle share, most activations alive) of one rank in one step."""
    inside = [e for e in events if start <= e[3] < end]
    busy = sum(e[4] - e[3] for e in inside if e[1] in "FBIW")
    busy -= sum(e[4] - e[3] for e in inside if e[1] == "recv")  # waiting, inside an action
    alive = most = 0
    for _, kind, *_ in sorted((e for e in inside if e[1] in "FBW"), key=lambda e: e[3]):
        alive += 1 if kind == "F" else -1  # a W frees what its I kept
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
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, width, generator=g).to(device)
    y = torch.randint(0, width, (args.batch,), generator=g).to(device)  # width classes
    rows = []
    for m in args.microbatches:
        names = [n for n in args.schedules if n != "DualPipeV" or m >= 2 * world_size]
        ways = [(impl, name) for name in names for impl in ("minddp", "stock")]
        built = {way: build(way, model, rank, world_size, m, device) for way in ways}
        for way, (runner, optimizer, _, ends, _) in built.items():
            for _ in range(args.warmup):
                one_step(runner, optimizer, x, y, ends)
        times, last = {way: [] for way in ways}, {}
        for r in range(args.rounds):
            order = ways[r % len(ways):] + ways[:r % len(ways)]  # each way first in turn
            for way in order:
                runner, optimizer, _, ends, _ = built[way]
                last[way] = one_step(runner, optimizer, x, y, ends)
                times[way].append(last[way][1] - last[way][0])
        mine = {}
        for way in ways:
            _, idle, alive = stage_shares(built[way][2].events, *last[way])
            per_activation = saved_bytes(built[way][4], (args.batch // m, width))
            mine[way] = [idle, alive, alive * per_activation / 2**20,
                         statistics.median(times[way]), times[way]]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (mine, [e for way in ways if way[0] == "minddp"
                                                 for e in _events_of(built[way][2], last[way],
                                                                     way)]))
        laid_out = {name: figures(name, v, lists, world_size, m)
                    for name, (v, lists) in schedules(world_size, m).items() if lists}
        step = {way: max(r[0][way][3] for r in everyone) for way in ways}  # the slowest rank
        rounds = {way: [max(t) for t in zip(*(r[0][way][4] for r in everyone))] for way in ways}
        for way in ways:  # (model: the width's name)
            impl, name = way
            v = stages_per_rank(name)
            rows.append({"ranks": world_size, "model": size, "m": m, "way": f"{impl} {name}",
                         "stages per rank": v,
                         "idle": [r[0][way][0] for r in everyone],
                         "formula": None if name not in ONE_STAGE + ("Interleaved1F1B",
                                                                     "LoopedBFS")
                         else (world_size - 1) / (v * m + world_size - 1),
                         "laid out": laid_out[name]["bubble"],
                         "alive": [r[0][way][1] for r in everyone],
                         "activations MB": [r[0][way][2] for r in everyone],
                         "ms": step[way] * 1e3,
                         "vs stock gpipe": step[way] / step.get(("stock", "GPipe"), float("nan")),
                         "vs stock": step[way] / step["stock", name],
                         "per round": per_round(rounds[way], rounds["stock", name]),
                         "events": [r[1] for r in everyone] if impl == "minddp" else None})
    return rows


def _events_of(recorder, span, way):
    start, end = span
    return [(way[1], stage, kind, i, s - start, e - start)
            for stage, kind, i, s, e in recorder.events if start <= s < end]


HEADERS = ["ranks", "model", "m", "way", "idle per rank", "formula", "laid out",
           "alive per rank", "activations MB per rank", "median ms/step", "vs stock GPipe",
           "minddp / stock", "per round (q1-q3)"]


def table_row(r):
    return [r["ranks"], r["model"], r["m"], r["way"],
            " ".join(f"{v:.0%}" for v in r["idle"]),
            "-" if r["formula"] is None else f"{r['formula']:.1%}", f"{r['laid out']:.1%}",
            " ".join(map(str, r["alive"])), " ".join(f"{v:.1f}" for v in r["activations MB"]),
            f"{r['ms']:.2f}", f"{r['vs stock gpipe']:.2f}x",
            f"{r['vs stock']:.2f}x" if r["way"].startswith("minddp") else "",
            r["per round"] if r["way"].startswith("minddp") else ""]


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
