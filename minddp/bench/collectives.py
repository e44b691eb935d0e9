"""Chapter 0's collectives beside gloo's: time per call, bytes sent, the alpha-beta fit.

    minddp collectives-bench                          # W = 2, 3, 4, 8; 1 KiB .. 64 MiB
    minddp collectives-bench --png docs/collectives.png --format github
    minddp collectives-bench --world-sizes 3 --sizes 1K 256K --rounds 3

Every algorithm of minddp/collectives/ and gloo's own collective of the same kind, on
float32 tensors of --sizes bytes (N: what a rank hands in; all_gather: what it gathers), on
gloo ranks started here, one process each, over loopback. A call's time is the slowest
rank's (all start together after a barrier), the median of --rounds rounds (10x as many at
256 KiB and below, 3x at 4 MiB), the contenders in a shuffled order each round. minddp's
run without the shape check (the algorithm alone); the check's own round is timed as a
row of its own ("shape check", at any size).
"bytes sent" is the most one rank passes to isend in one call, counted (gloo's, in C++, are
not), beside cost.sent_bytes's formula (exact where N divides into the blocks).
Then, per algorithm and world size, one alpha and one beta fitted over the sizes to the
model T = steps * alpha + path_bytes * beta (minddp/collectives/cost.py; gloo's with the
formula of the algorithm it runs: its ring all_reduce, ring all_gather, binomial broadcast
and pairwise all_to_all; its reduce_scatter_tensor, whose bits are its all_reduce's on the
whole input, as that all_reduce), weighted so that every point's relative error counts
alike; the fit's error is the median and the largest |T_model / T - 1|. Last, how far the
tree and halving-doubling land from gloo's all_reduce (the ring: nowhere), on 65 536 values.
"""

from ..run.cli import ArgumentParser
from . import at_least, check_outputs

SIZES = {"1K": 2 ** 10, "16K": 2 ** 14, "256K": 2 ** 18, "4M": 2 ** 22, "64M": 2 ** 26}


def parse(argv=None):
    parser = ArgumentParser(prog="minddp collectives-bench",
                            description=__doc__.split("\n\n")[0])
    parser.set_defaults(prog="minddp collectives-bench", backend="gloo", device="cpu", steps=1)
    parser.add_argument("--world-sizes", nargs="+", type=at_least(2), default=[2, 3, 4, 8],
                        help="started here, one after another")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES),
                        help="bytes per rank and call")
    parser.add_argument("--rounds", type=at_least(1), default=3,
                        help="timed calls per contender (the median is kept)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads per rank")
    parser.add_argument("--png", metavar="PATH", help="time against size, with the model")
    parser.add_argument("--format", default="simple", help="tabulate format, e.g. github")
    return check_outputs(parser.parse_args(argv), "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import contextlib  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402

from .. import collectives as mine  # noqa: E402
from ..collectives import checks, cost  # noqa: E402
from .harness import collect_rows  # noqa: E402


@contextlib.contextmanager
def counting_sent(counted):
    """Add the bytes this rank hands to isend (all of chapter 0's go through
    dist.batch_isend_irecv) to counted[0]."""
    original = dist.batch_isend_irecv

    def counting(ops):
        counted[0] += sum(op.tensor.numel() * op.tensor.element_size()
                          for op in ops if op.op is dist.isend)
        return original(ops)
    dist.batch_isend_irecv = counting
    try:
        yield
    finally:
        dist.batch_isend_irecv = original


def contenders(nbytes, world_size):
    """{name: (family, model, call)}: each call runs one collective on fresh tensors."""
    n = nbytes // 4
    share = max(1, n // world_size)  # (W = 3: the gathered tensor a few elements short)
    x, piece, whole = torch.ones(n), torch.ones(share), torch.ones(share * world_size)
    gathered, received = torch.empty(share * world_size), torch.empty(share * world_size)
    return {
        "gloo all_reduce": ("all_reduce", "ring all_reduce", lambda: dist.all_reduce(x)),
        "ring all_reduce": ("all_reduce", "ring all_reduce", lambda: mine.all_reduce(x)),
        "tree all_reduce": ("all_reduce", "tree all_reduce", lambda: mine.tree_all_reduce(x)),
        "halving-doubling": ("all_reduce", "halving-doubling",
                             lambda: mine.halving_doubling_all_reduce(x)),
        "gloo all_gather": ("all_gather", "all_gather",
                            lambda: dist.all_gather_single(gathered, piece)),
        "ring all_gather": ("all_gather", "all_gather",
                            lambda: mine.all_gather_into_tensor(gathered, piece)),
        "gloo reduce_scatter": ("reduce_scatter", "ring all_reduce",
                                lambda: dist.reduce_scatter_single(piece, whole)),
        "ring reduce_scatter": ("reduce_scatter", "reduce_scatter",
                                lambda: mine.reduce_scatter_tensor(piece, whole)),
        "gloo broadcast": ("broadcast", "tree broadcast", lambda: dist.broadcast(x, src=0)),
        "tree broadcast": ("broadcast", "tree broadcast", lambda: mine.broadcast(x, src=0)),
        "chain broadcast": ("broadcast", "chain broadcast",
                            lambda: mine.chain_broadcast(x, src=0)),
        "gloo all_to_all": ("all_to_all", "all_to_all",
                            lambda: dist.all_to_all_single(received, whole)),
        "pairwise all_to_all": ("all_to_all", "all_to_all",
                                lambda: mine.all_to_all_single(received, whole)),
        "shape check": ("check", "shape check", lambda: _shape_check(x)),
    }


def _shape_check(x):
    checks.SAME_SHAPE_CHECKED = True  # the check alone: the algorithms run without it
    try:
        checks.check_same_shape(x, None, "collectives-bench")
    finally:
        checks.SAME_SHAPE_CHECKED = False


def orders(rank, world_size, n=2 ** 16):
    """How far each all_reduce lands from gloo's on n float32 values spread over 2^-20..2^20:
    rows of (elements unlike gloo's, the largest gap in units of u * sum_r |x_r|)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-20, 21, (n,), generator=g)
    gloos, scale = x.clone(), x.double().abs()
    dist.all_reduce(gloos)
    dist.all_reduce(scale)  # sum_r |x_r|, in float64
    unit = torch.finfo(torch.float32).eps / 2
    rows = []
    for name, call in (("ring all_reduce", mine.all_reduce), ("tree all_reduce",
                       mine.tree_all_reduce), ("halving-doubling",
                                               mine.halving_doubling_all_reduce)):
        ours = x.clone()
        call(ours)
        gap = ((ours.double() - gloos.double()).abs() / (unit * scale)).max().item()
        rows.append({"table": "orders", "ranks": world_size, "name": name, "n": n,
                     "unlike": int((ours != gloos).sum()), "gap": gap})
    return rows


def time_size(size, args, rank, world_size, device):
    """One size at one world size: a row per contender (rank 0's list; times: slowest)."""
    nbytes = SIZES[size]
    calls = contenders(nbytes, world_size)
    checks.SAME_SHAPE_CHECKED = False  # the algorithms alone; "shape check" times the check
    samples = {name: [] for name in calls}
    sent = {}
    for name, (_, _, call) in calls.items():
        call()  # warm up: the first call allocates, and starts the collectives' thread
        counted = [0]
        with counting_sent(counted):
            call()
        most = torch.tensor([counted[0]], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        sent[name] = int(most.item()) if not name.startswith("gloo") else None
    # Small calls are quick and noisy (2 cores shared by W ranks): more of them.
    rounds = args.rounds * (10 if nbytes <= 2 ** 18 else 3 if nbytes <= 2 ** 22 else 1)
    for r in range(rounds):
        for name in random.Random(r).sample(list(calls), len(calls)):
            dist.barrier()  # start together: an early rank must not wait inside the call
            start = time.perf_counter()
            calls[name][2]()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            samples[name].append(took.item())
    checks.SAME_SHAPE_CHECKED = True
    first = orders(rank, world_size) if size == args.sizes[0] else []
    return first + [{"table": "time", "ranks": world_size, "bytes": nbytes, "name": name,
                     "family": family, "model": model, "seconds": statistics.median(samples[name]),
                     "sent": sent[name]} for name, (family, model, _) in calls.items()]


def fit(rows):
    """{(name, W): (alpha s, beta s/byte, median and largest |model / T - 1|)}: one fit per
    algorithm and world size (W ranks share the cores: a step's fixed cost grows with W)."""
    fitted = {}
    for name, world_size in dict.fromkeys((r["name"], r["ranks"]) for r in rows):
        mine_rows = [r for r in rows if r["name"] == name and r["ranks"] == world_size]
        terms = numpy.array([[cost.steps(r["model"], r["bytes"], r["ranks"]),
                              cost.path_bytes(r["model"], r["bytes"], r["ranks"])]
                             for r in mine_rows], dtype=float)
        times = numpy.array([r["seconds"] for r in mine_rows])
        weighted = terms / times[:, None]  # each point's relative error counts alike
        alpha, beta = numpy.linalg.lstsq(weighted, numpy.ones(len(times)), rcond=None)[0]
        if beta < 0 or alpha < 0:  # a negative term is no cost: fit the other one alone
            column = 0 if beta < 0 else 1
            only = numpy.linalg.lstsq(weighted[:, [column]], numpy.ones(len(times)),
                                      rcond=None)[0][0]
            alpha, beta = (only, 0.0) if column == 0 else (0.0, only)
        errors = numpy.abs(terms @ numpy.array([alpha, beta]) / times - 1)
        fitted[name, world_size] = (alpha, beta, float(numpy.median(errors)),
                                    float(errors.max()))
    return fitted


def machine_line(args):
    return (f"torch {torch.__version__} | gloo on cpu, loopback | {os.cpu_count()} CPUs"
            f" {platform.machine()} | {args.threads} thread(s) per rank")


def main(args):
    everything = collect_rows(args, time_size)
    rows = [r for r in everything if r["table"] == "time"]
    print(f"{machine_line(args)} | median of {args.rounds} call(s), the slowest rank's")
    table = []
    for r in rows:
        gloo = next(g["seconds"] for g in rows if g["ranks"] == r["ranks"]
                    and g["bytes"] == r["bytes"] and g["family"] == r["family"]
                    and g["name"].startswith("gloo")) if r["family"] != "check" else None
        formula = max(cost.sent_bytes(r["model"], r["bytes"], r["ranks"], rank)
                      for rank in range(r["ranks"]))
        table.append([r["ranks"], _size(r["bytes"]), r["family"], r["name"],
                      f"{r['seconds'] * 1e3:.3f}", f"{r['seconds'] / gloo:.2f}x" if gloo else "",
                      "" if r["sent"] is None else f"{r['sent']:,}",
                      "" if r["sent"] is None else f"{formula:,}"])
    print(tabulate(table, headers=["ranks", "N", "collective", "algorithm", "ms", "vs gloo",
                                   "bytes sent (most)", "formula (N/W blocks)"],
                   tablefmt=args.format, disable_numparse=True))
    fitted = fit(rows)
    world_sizes = sorted({r["ranks"] for r in rows})
    print("\nthe alpha-beta fit, T = steps * alpha + path_bytes * beta, per algorithm and W:"
          " alpha (us), 1/beta (MB/s), |model / T - 1| median / largest")
    print(tabulate([[name] + [_fitted(fitted.get((name, w))) for w in world_sizes]
                    for name in dict.fromkeys(r["name"] for r in rows)],
                   headers=["algorithm"] + [f"W = {w}" for w in world_sizes],
                   tablefmt=args.format, disable_numparse=True))
    print("\nhow far from gloo's all_reduce (float32 values spread over 2^-20 .. 2^20;"
          " gap in units of u sum_r |x_r|, u = 2^-24):")
    print(tabulate([[r["ranks"], r["name"], f"{r['unlike']:,} of {r['n']:,}",
                     f"{r['gap']:.2f}"] for r in everything if r["table"] == "orders"],
                   headers=["ranks", "algorithm", "elements unlike gloo's", "largest gap"],
                   tablefmt=args.format, disable_numparse=True))
    if args.png:
        draw(rows, fitted, args.png, machine_line(args))
        print(f"picture: {args.png}")


def _fitted(found):
    if found is None:
        return ""
    alpha, beta, median, largest = found
    speed = f"{1 / beta / 1e6:,.0f}" if beta else "-"
    return f"{alpha * 1e6:,.0f} us, {speed} MB/s, {median:.0%}/{largest:.0%}"


def _size(nbytes):
    return next(name for name, value in SIZES.items() if value == nbytes)


FAMILIES = [("all_reduce", ["gloo all_reduce", "ring all_reduce", "tree all_reduce",
                            "halving-doubling"]),
            ("all_gather, reduce_scatter, all_to_all", [
                "gloo all_gather", "ring all_gather", "gloo reduce_scatter",
                "ring reduce_scatter", "gloo all_to_all", "pairwise all_to_all"]),
            ("broadcast", ["gloo broadcast", "tree broadcast", "chain broadcast"])]


def draw(rows, fitted, path, machine):
    """Time against size (log-log), one panel per world size and family: the measured
    points, and the fitted model's line through them. Returns {panel: [names]}."""
    from ..tools.pictures import _pyplot, save
    plt = _pyplot()
    sizes = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(len(FAMILIES), len(sizes), figsize=(4.2 * len(sizes), 9.5),
                             squeeze=False)
    colours = plt.get_cmap("tab10")
    drawn = {}
    for column, world_size in enumerate(sizes):
        for line, (family, names) in enumerate(FAMILIES):
            ax = axes[line][column]
            for k, name in enumerate(names):
                mine_rows = sorted((r for r in rows if r["name"] == name
                                    and r["ranks"] == world_size), key=lambda r: r["bytes"])
                if not mine_rows:
                    continue
                alpha, beta = fitted[name, world_size][:2]
                xs = [r["bytes"] for r in mine_rows]
                model = [cost.steps(r["model"], r["bytes"], world_size) * alpha
                         + cost.path_bytes(r["model"], r["bytes"], world_size) * beta
                         for r in mine_rows]
                style = dict(color=colours(k), marker="o" if name.startswith("gloo") else "s")
                ax.plot(xs, [r["seconds"] * 1e3 for r in mine_rows], linestyle="none",
                        label=name, **style)
                ax.plot(xs, [m * 1e3 for m in model], linestyle="--", linewidth=0.9,
                        color=colours(k))
                drawn.setdefault((family, world_size), []).append(name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{family}, {world_size} ranks", fontsize=9)
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("ms (slowest rank)")
            if column == 0:
                ax.legend(fontsize=6.5)
    save(fig, path, machine)
    plt.close(fig)
    return drawn


if __name__ == "__main__":
    main(ARGS)
