"""`minddp grade FILE`: a student's lesson file beside stock PyTorch, bit for bit, and what's off.

    minddp exercise naive exercises/                  # a starting file (writer.py)
    minddp grade exercises/naive.py                   # at the exercise's world sizes
    minddp grade exercises/naive.py --ranks 1 2 3
    minddp grade minddp/ddp/naive.py                      # the lesson itself: every check passes
    minddp grade my_ddp.py --exercise naive --json    # one JSON report, for a teacher's tools
    minddp grade submissions/ --exercise naive        # a folder: one table, a row per file

The file is loaded as the lesson it replaces (its relative imports reach minddp's other
lessons), on gloo ranks started here, one group of ranks per world size, each under a hard
time limit. Each check (checks/) runs the student's code and stock's on the same models
and data and prints `passed` (bit for bit) or the first difference, with its step, rank,
parameter and element, and a diagnosis (judge/diagnosis.py): a factor of the world size,
weights never copied from rank 0, a skipped average, a summation order, the optimizer... A
rank that raises is reported at its line in the student's file; a rank stuck in a collective
past --timeout (or as soon as two ranks are inside one call of a group, called unlike), with
the collective each rank was last in. A DDP average, the ring's sums, clip's norm and scale
that are not stock's bits but lie within the rounding bound of the exact result are
`correct` (judge/bound.py).
Exit status 0 only when every check passes or is correct; 1 when one fails; 2 for a file or
a flag the grader cannot use.
"""

import argparse
import csv
import json
import pathlib
import sys

from ..launch.usage_error import UsageError
from ..run import warm
from .exercises import EXERCISES
from .ranks.world import run_world
from .student import check_signatures, exercise_of, load



def parse(argv=None):
    parser = argparse.ArgumentParser(prog="minddp grade", description=__doc__.split("\n")[0])
    parser.add_argument("file", help="the student's file (a lesson file, rewritten), or a"
                                     " folder of them (with --exercise): one table")
    parser.add_argument("--exercise", choices=list(EXERCISES),
                        help="which exercise (default: the one whose names the file defines)")
    parser.add_argument("--ranks", nargs="+", type=int, help="world sizes to grade at")
    parser.add_argument("--timeout", type=float, default=60, metavar="S",
                        help="seconds the checks of a world size may take once its ranks have"
                             " started, before they count as stuck")
    parser.add_argument("--json", action="store_true", help="one JSON report on stdout")
    parser.add_argument("--csv", action="store_true",
                        help="a folder's table as CSV: a row per file and check")
    return parser.parse_args(argv)


def report(file, name, results):
    """The text report: a line per check, its difference and diagnosis, and the verdict."""
    exercise = EXERCISES[name]
    lines = [f"graded {file}: exercise {name!r} (minddp/{exercise.path}) against"
             f" {exercise.against}"]
    for r in results:
        outcome = outcome_of(r)
        lines.append(f"  {r['check']}: {outcome if r['passed'] else 'FAILED'}"
                     + (f" ({r['where']})" if outcome == "passed" and r["where"] else ""))
        if outcome != "passed":
            lines += [f"      at:        {r['where']}", f"      diagnosis: {r['diagnosis']}"]
    passed = sum(r["passed"] for r in results)
    bitwise = sum(outcome_of(r) == "passed" for r in results)
    lines.append(f"verdict: {passed} of {len(results)} checks passed"
                 + (": every one, bit for bit" if bitwise == len(results) else
                    f" ({passed - bitwise} correct, not stock's bits)" if passed > bitwise
                    else ""))
    return "\n".join(lines)


def grade(file, name, ranks, timeout):
    """[each check's result] for one student's file (UsageError: a file the grader cannot use)."""
    bad = [r for r in ranks if r not in EXERCISES[name].allowed]
    if bad:
        raise UsageError(f"--ranks {bad[0]}: exercise {name!r} is checked at"
                         f" {', '.join(map(str, EXERCISES[name].allowed))} ranks",
                         hint=f"--ranks {' '.join(map(str, EXERCISES[name].ranks))}")
    warm.context(start=True)  # the ranks' server imports torch while this process loads the file
    try:
        student = load(file, EXERCISES[name].lesson)
    except Exception:  # it does not import: each rank reports where, below
        student = None
    if student is not None:
        check_signatures(student, name)
    results = []
    for i, world_size in enumerate(ranks):
        results += run_world(file, name, world_size, timeout)
        left = ranks[i + 1:]
        if left and results[-1].get("stuck"):
            # a hang costs the student one --timeout, not one per world size
            results.append({"check": f"{', '.join(map(str, left))} ranks: not run",
                            "passed": False, "where": "", "diagnosis": f"the {world_size} ranks"
                            f" above never finished: fix that first (each world size would"
                            f" wait as long)"})
            break
    return results


def grade_folder(folder, args):
    """A teacher's table: every .py file in `folder` graded for --exercise; exit 0 if all pass."""
    if args.exercise is None:
        raise UsageError(f"{folder} is a folder: its files are graded for one exercise",
                         hint=f"minddp grade {folder} --exercise NAME")
    rows, reports = [], []
    for file in sorted(folder.glob("*.py")):
        try:
            name = exercise_of(file, args.exercise)
            results = grade(file, name, args.ranks or EXERCISES[name].ranks, args.timeout)
        except UsageError as refused:
            results = [{"check": "the file", "passed": False, "where": "",
                        "diagnosis": refused.message}]
        for r in results:
            r["outcome"] = outcome_of(r)
        failed = [r for r in results if not r["passed"]]
        correct = sum(outcome_of(r) == "correct" for r in results)
        rows.append([file.name, f"{len(results) - len(failed)} of {len(results)}"
                     + (f" ({correct} correct)" if correct else ""),
                     failed[0]["check"] if failed else "",
                     failed[0]["diagnosis"] if failed else ""])
        reports.append({"file": str(file), "passed": not failed, "checks": results})
    if args.json:
        print(json.dumps({"exercise": args.exercise, "files": reports}, indent=1))
    elif args.csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(["file", "check", "outcome", "where", "diagnosis"])
        for report_ in reports:
            for r in report_["checks"]:
                writer.writerow([report_["file"], r["check"], outcome_of(r), r["where"],
                                 r["diagnosis"]])
    else:
        from tabulate import tabulate
        print(f"graded {folder}: exercise {args.exercise!r}, {len(rows)} files")
        print(tabulate(rows, headers=["file", "checks passed", "first failed", "diagnosis"]))
    return 0 if rows and all(r["passed"] for r in reports) else 1


def outcome_of(result):
    """passed (stock's bits), correct (right within a stated bound, judge/bound.py), failed."""
    return result.get("outcome", "passed" if result["passed"] else "failed")


def main(argv=None):
    from ..run.errors import exit_on_usage_error
    args = parse(argv)
    file = pathlib.Path(args.file)
    with exit_on_usage_error():
        if file.is_dir():
            return grade_folder(file, args)
        name = exercise_of(file, args.exercise)
        ranks = args.ranks or EXERCISES[name].ranks
        results = grade(file, name, ranks, args.timeout)
    for r in results:
        r["outcome"] = outcome_of(r)
    if args.json:
        print(json.dumps({"file": str(file), "exercise": name, "ranks": list(ranks),
                          "passed": all(r["passed"] for r in results), "checks": results},
                         indent=1))
    else:
        print(report(file, name, results))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
