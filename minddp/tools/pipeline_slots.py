"""Every pipeline schedule's actions laid out in time: the bubble and the activations alive.

    minddp pp-schedules                                  # 4 ranks, 8 microbatches
    minddp pp-schedules --ranks 2 --microbatches 4 --png docs/pp-schedules.png

Each rank runs its list (the lessons' lists, equal to stock's: tests/test_pp_interleaved.py)
in order; an action starts when its rank is free and what it needs is done: a forward needs
the stage before's forward of the same microbatch, a backward (B or I) this stage's forward
and the stage after's backward, a W its I. Durations in units of one rank's forward of a
microbatch with one stage per rank: F 1, I 1, W 1, B 2 (I and W together), divided by the
stages per rank (each is that much smaller); communication free. Per schedule:

  bubble   1 - busy / (ranks x makespan): the share of the step the ranks idle
  formula  (p-1)/(m+p-1) for one stage per rank, (p-1)/(v*m+p-1) for v stages per rank
           looped or interleaved; the zero-bubble schedules have no closed form here
  alive    the most (stage, microbatch) activations a rank holds (a forward done, its B or
           W not yet: I keeps the graph for W); with v stages per rank each is 1/v of a
           one-stage microbatch's
"""

from ..pp.interleaved import interleaved_1f1b, looped_bfs, parse_action
from ..pp.schedules import gpipe, one_f_one_b
from ..pp.v_shaped import dualpipev, zbv
from ..pp.zero_bubble import add_bubbles

COST = {"F": 1, "I": 1, "W": 1, "B": 2}


def schedules(p, m):
    """{name: (stages per rank, every rank's list of "sFi" actions, None for a wait)}."""
    def single(order):
        return [[f"{r}{kind}{i}" for kind, i in order(r, p, m)] for r in range(p)]
    return {
        "GPipe": (1, single(gpipe)),
        "1F1B": (1, single(one_f_one_b)),
        "Interleaved1F1B": (2, [interleaved_1f1b(r, p, 2, m) for r in range(p)]),
        "LoopedBFS": (2, [looped_bfs(r, p, 2, m) for r in range(p)]),
        "InterleavedZeroBubble": (2, add_bubbles([interleaved_1f1b(r, p, 2, m, True)
                                                  for r in range(p)], 2 * p)),
        "ZBVZeroBubble": (2, [zbv(r, p, m) for r in range(p)]),
        "DualPipeV": (2, [dualpipev(r, p, m) for r in range(p)] if m >= 2 * p else None),
    }


def timeline(lists, num_stages, per_rank=1):
    """[[(action, start, end)] per rank]: each rank's actions in order, each as early as
    its rank and what it needs allow (per_rank stages each rank: each action that much
    shorter). Raises ValueError if no rank can go on (a deadlock)."""
    todo = [[a for a in actions if a] for actions in lists]
    done, free, out = {}, [0] * len(lists), [[] for _ in lists]
    while any(todo):
        progressed = False
        for r, actions in enumerate(todo):
            while actions:
                s, kind, i = parse_action(actions[0])
                needs = [(s, "F", i)] if kind != "F" else []
                if kind == "F" and s > 0:
                    needs.append((s - 1, "F", i))
                if kind in "BI" and s < num_stages - 1:
                    needs.append((s + 1, "B", i) if (s + 1, "B", i) in done else (s + 1, "I", i))
                if kind == "W":
                    needs = [(s, "I", i)]
                if not all(n in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = done[s, kind, i] = start + COST[kind] / per_rank
                out[r].append((actions.pop(0), start, free[r]))
                progressed = True
        if not progressed:
            raise ValueError(f"no rank can go on: {[a[:1] for a in todo]}")
    return out


def figures(name, v, lists, p, m):
    """The row of the table: bubble, formula, most microbatches alive per rank."""
    spans = timeline(lists, v * p, v)
    makespan = max(end for rank in spans for _, _, end in rank)
    busy = sum(end - start for rank in spans for _, start, end in rank)
    alive = []
    for actions in lists:
        now = peak = 0
        for a in filter(None, actions):
            now += {"F": 1, "B": -1, "W": -1}.get(parse_action(a)[1], 0)
            peak = max(peak, now)
        alive.append(peak)
    formula = None if "Zero" in name or "Dual" in name else (p - 1) / (v * m + p - 1)
    return {"schedule": name, "stages per rank": v, "bubble": 1 - busy / (p * makespan),
            "step": makespan,
            "formula": formula, "alive": alive, "spans": spans, "makespan": makespan}


COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868"}


def draw(rows, path, p, m):
    """A panel per schedule, a row per rank, each action a bar labelled "sFi"."""
    from .pictures import _pyplot
    plt = _pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(13, 1.0 + 0.32 * p * len(rows)),
                             squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        for r, spans in enumerate(row["spans"]):
            for action, start, end in spans:
                kind = parse_action(action)[1]
                ax.barh(p - 1 - r, end - start, left=start, height=0.8, color=COLORS[kind],
                        alpha=0.55 if kind == "I" else 1, edgecolor="white", linewidth=0.5)
                ax.text((start + end) / 2, p - 1 - r, action, ha="center", va="center",
                        fontsize=5, color="white")
        ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))], fontsize=7)
        ax.set_xlim(0, max(r["makespan"] for r in rows))
        formula = f", formula {row['formula']:.0%}" if row["formula"] is not None else ""
        ax.set_title(f"{row['schedule']} ({row['stages per rank']} stage(s) per rank): bubble"
                     f" {row['bubble']:.0%}{formula}, most microbatches alive per rank"
                     f" {' '.join(map(str, row['alive']))}", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("time, in one-stage-per-rank forwards (F 1, I 1, W 1, B 2, divided"
                           " by the stages per rank; communication free)")
    fig.suptitle(f"Every schedule's actions on {p} ranks, {m} microbatches (minddp's lists ="
                 " stock's)", fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    from ..run.cli import ArgumentParser
    parser = ArgumentParser(prog="minddp pp-schedules", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--png", metavar="PATH", help="draw every schedule (matplotlib)")
    parser.add_argument("--format", default="simple", help="tabulate format, e.g. github")
    args = parser.parse_args(argv)
    from tabulate import tabulate
    p, m = args.ranks, args.microbatches
    rows = [figures(name, v, lists, p, m) for name, (v, lists) in schedules(p, m).items()
            if lists is not None]
    print(f"{p} ranks, {m} microbatches; F 1, I 1, W 1, B 2 units (divided by the stages per"
          " rank), communication free")
    print(tabulate([[r["schedule"], r["stages per rank"], f"{r['step']:g}", f"{r['bubble']:.1%}",
                     "-" if r["formula"] is None else f"{r['formula']:.1%}",
                     " ".join(map(str, r["alive"])),
                     f"{max(r['alive']) / r['stages per rank']:g}"] for r in rows],
                   headers=["schedule", "stages per rank", "step (units)", "bubble", "formula",
                            "most (stage, microbatch) activations alive, per rank",
                            "most, in one-stage microbatches"], tablefmt=args.format))
    if args.png:
        draw(rows, args.png, p, m)
        print(f"picture: {args.png}")
    return rows


if __name__ == "__main__":
    main()
