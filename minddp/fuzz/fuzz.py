"""`minddp fuzz`: draw cases, run each on its mesh and in one process, report the first difference.

    minddp fuzz --ranks 4 --cases 16 --seed 0
    minddp fuzz --ranks 2 --time 120              # as many cases as two minutes allow
    minddp fuzz --case 1234 --ranks 4             # one case again, from its seed

Case i of a run is drawn from seed (--seed x 100003 + i): one case's seed reproduces it alone.
A line per case: its shape and sizes, then IDENTICAL, refused (the lesson's own line), raised
(a rank's error: a lesson that took a case and could not run it), or DIFFERENT with where the
tables first part and the command that reproduces it. The last line counts them:
"N cases, M shapes, K refused, D differences". Exit status 1 if any case differed or
raised, 0 otherwise.
"""

import argparse
import os
import sys
import tempfile
import time

from ..run.cli import ArgumentParser
from . import planted
from .cases import draw, refusal


def parse(argv=None):
    parser = ArgumentParser(prog="minddp fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, choices=[2, 4, 8],
                        help="the largest mesh drawn (ranks started here, gloo)")
    parser.add_argument("--cases", type=int,
                        help="cases to draw (default 16; with --time, as many as it allows)")
    parser.add_argument("--seed", type=int, default=0, help="the run's first case's seed")
    parser.add_argument("--case", type=int, metavar="SEED", help="this one case only")
    parser.add_argument("--time", type=float, metavar="S",
                        help="draw no more cases once S seconds are spent")
    parser.add_argument("--first", action="store_true",
                        help="draw no more cases once one differs (or raises)")
    parser.add_argument("--batch-of", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--plant", choices=planted.PLANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cases is None:
        args.cases = 16 if args.time is None else 10**9
    return args


def seeds(args):
    if args.case is not None:
        return [args.case]
    return [args.seed * 100003 + i for i in range(args.cases)]


def run(args, say=print):
    """Every case of the run: {seed: (case, verdict, detail)}; stops drawing past --time."""
    from .run import run_group
    start, results = time.monotonic(), {}
    todo = seeds(args)
    with tempfile.TemporaryDirectory() as folder:
        found = False
        while todo and not found and (args.time is None or time.monotonic() - start < args.time):
            batch, todo = todo[:args.batch_of], todo[args.batch_of:]
            cases = [draw(seed, args.ranks) for seed in batch]
            taken = [c for c in cases if refusal(c) is None]
            errors = run_group(taken, True, args.plant, folder)
            for size in sorted({c.world_size for c in taken}):
                errors.update(run_group([c for c in taken if c.world_size == size
                                         and c.seed not in errors], False, args.plant, folder))
            for case in cases:
                why = refusal(case)
                if why is None and case.seed in errors:
                    verdict, detail = "raised", errors[case.seed]
                elif why is None:
                    verdict, detail = compare(case, folder)
                else:
                    verdict, detail = "refused", why
                results[case.seed] = (case, verdict, detail)
                say(line(case, verdict, detail, args))
                found = found or (args.first and verdict in ("DIFFERENT", "raised"))
    return results


def compare(case, folder):
    """(verdict, detail): the case's mesh table against its one process's."""
    from ..tools.across import compare_whole
    from ..tools.diff import ulp_distance
    from ..tools.tables import TableError, read_table
    tables = [read_table(os.path.join(folder, f"{case.seed}-{t}.txt")) for t in ("mesh", "one")]
    try:
        _, first = compare_whole(*tables[0], *tables[1], ulp_distance)
    except TableError as apart:  # other shapes, or ranks that disagree: a bug as well
        return "DIFFERENT", str(apart)
    if first is None:
        return "IDENTICAL", ""
    return "DIFFERENT", (f"step {first[0]}, {first[1]!r}, element {list(first[2])}:"
                         f" {first[3]!r} vs {first[4]!r} in one process, {first[5]} units in"
                         f" the last place apart")


def line(case, verdict, detail, args):
    text = f"case {case.seed}: {case.describe()}: {verdict}"
    if verdict in ("DIFFERENT", "raised"):
        again = f"minddp fuzz --case {case.seed} --ranks {args.ranks}"
        again += f" --plant {args.plant}" if args.plant else ""
        return f"{text}\n    {detail}\n    reproduce: {again}"
    return text + (f" ({detail})" if detail else "")


def summary(results):
    verdicts = [v for _, v, _ in results.values()]
    shapes = {(c.dp, c.tp, c.pp) for c, v, _ in results.values() if v != "refused"}
    bad = verdicts.count("DIFFERENT") + verdicts.count("raised")
    return (f"{len(results)} cases, {len(shapes)} shapes, {verdicts.count('refused')} refused,"
            f" {bad} differences")


def main(argv=None):
    args = parse(argv)
    results = run(args)
    print(summary(results))
    return 1 if any(v in ("DIFFERENT", "raised") for _, v, _ in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
