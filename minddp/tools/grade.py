"""`minddp grade FILE`: a student's lesson file beside stock PyTorch, bit for bit, and what is wrong.

    minddp exercise naive exercises/                  # a starting file (exercises.py)
    minddp grade exercises/naive.py                   # at the exercise's world sizes
    minddp grade exercises/naive.py --ranks 1 2 3
    minddp grade minddp/naive.py                      # the lesson itself: every check passes
    minddp grade my_ddp.py --exercise naive --json    # one JSON report, for a teacher's tools

The file is loaded as the lesson it replaces (its relative imports reach minddp's other
lessons), on gloo ranks started here, one group of ranks per world size, each under a hard
time limit. Each check (grade_checks.py) runs the student's code and stock's on the same
models and data and prints `passed` (bit for bit) or the first difference, with its step,
rank, parameter and element, and a diagnosis (diagnosis.py): a factor of the world size,
weights never copied from rank 0, a skipped average, a summation order, the optimizer... A
rank that raises is reported at its line in the student's file; a rank stuck in a collective
past --timeout, with the collective each rank was last in. Exit status 0 only when every
check passes; 1 when one fails; 2 for a file or a flag the grader cannot use.
"""

import argparse
import ast
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

from ..usage_error import UsageError
from .exercises import EXERCISES

STARTING_S = 600  # the most a rank may take to import torch and join the group
# (isend and irecv stay unwrapped: P2POp checks that its op IS dist.isend or dist.irecv)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_to_all_single", "barrier", "send", "recv", "batch_isend_irecv",
               "all_gather_object", "gather_object")


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="minddp grade", description=__doc__.split("\n")[0])
    parser.add_argument("file", help="the student's file (a lesson file, rewritten)")
    parser.add_argument("--exercise", choices=list(EXERCISES),
                        help="which exercise (default: the one whose names the file defines)")
    parser.add_argument("--ranks", nargs="+", type=int, help="world sizes to grade at")
    parser.add_argument("--timeout", type=float, default=60, metavar="S",
                        help="seconds the checks of a world size may take once its ranks have"
                             " started, before they count as stuck")
    parser.add_argument("--json", action="store_true", help="one JSON report on stdout")
    return parser.parse_args(argv)


def exercise_of(path, name=None):
    """The exercise a file answers: `name`, or the one whose names it defines (one line else)."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file", hint="the path of the student's .py file")
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError as error:
        raise UsageError(f"{path} line {error.lineno}: {error.msg}",
                         hint="python -m py_compile " + str(path)) from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    if name is None:
        fits = [e for e, spec in EXERCISES.items() if set(spec.names) <= defined]
        if len(fits) != 1:
            raise UsageError(f"{path} answers {'none' if not fits else ' and '.join(fits)} of"
                             f" the exercises (by the names it defines)",
                             hint="--exercise NAME; minddp exercise --list names them")
        name = fits[0]
    missing = [n for n in EXERCISES[name].names if n not in defined]
    if missing:
        raise UsageError(f"{path} defines no {missing[0]}: exercise {name!r} asks for"
                         f" {', '.join(EXERCISES[name].names)}",
                         hint=f"start from `minddp exercise {name}`")
    return name


def load(path, lesson):
    """The student's file as a module of the minddp package (its `from .x import` works)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"minddp._graded_{lesson}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_signatures(student, lesson):
    """One line for a required name whose parameters are not the lesson's."""
    import inspect
    for qualname in EXERCISES[lesson].todo:
        owner, _, method = qualname.partition(".")
        ours = getattr(student, owner)
        theirs = getattr(load_lesson(lesson), owner)
        if method:
            ours, theirs = getattr(ours, method, None), getattr(theirs, method)
        if ours is None:
            raise UsageError(f"{owner} has no method {method}", hint=f"the lesson's: {qualname}"
                             f"{inspect.signature(theirs)}")
        wanted, got = inspect.signature(theirs), inspect.signature(ours)
        if list(wanted.parameters) != list(got.parameters):
            raise UsageError(f"{qualname}{got} does not take the lesson's arguments",
                             hint=f"{qualname}{wanted}")


def load_lesson(name):
    import importlib
    return importlib.import_module(f"minddp.{EXERCISES[name].lesson}")


def _record_collectives(path, student_file):
    """Note each collective this rank enters and leaves, with the student's line that led
    there, in `path`: what a rank stuck past the timeout was waiting in."""
    import torch.distributed as dist
    log = open(path, "a", buffering=1)

    def wrap(name, original):
        def call(*args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            where = next((f"{pathlib.Path(f.filename).name} line {f.lineno}"
                          for f in reversed(stack) if f.filename == student_file),
                         "the grader, gathering the results" if any(
                             "grade_" in f.filename for f in stack[-3:]) else "stock's code")
            log.write(f"in {name} ({where})\n")
            result = original(*args, **kwargs)
            log.write("done\n")
            return result
        return call
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _rank(rank, world_size, file, name, tmp):
    import torch
    import torch.distributed as dist
    out = pathlib.Path(tmp)
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, on any machine
        torch.set_num_threads(1)
        from ..teardown import ddp_teardown
        from .grade_checks import CHECKS
        from .grade_pieces import CHECKS as PIECES
        dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank,
                                world_size=world_size)
        (out / f"rank{rank}.started").touch()  # the time limit counts from here: an import
        _record_collectives(out / f"rank{rank}.collectives", str(pathlib.Path(file).resolve()))
        student = load(pathlib.Path(file), EXERCISES[name].lesson)
        results = {**CHECKS, **PIECES}[name](student, rank, world_size)
        if rank == 0:
            (out / "results.json").write_text(json.dumps(results))
        del student
        ddp_teardown()
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        sys.exit(1)


def run_world(file, name, world_size, timeout):
    """The checks at one world size: [result], or one failed result naming the exception or
    the collective the ranks were stuck in."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_rank, args=(world_size, str(file), name, tmp),
                                     nprocs=world_size, start_method="spawn", join=False)
        out, failed = pathlib.Path(tmp), False
        deadline = time.monotonic() + STARTING_S  # (torch's import may take a while)
        started = False
        while not all(p.exitcode is not None for p in context.processes):
            failed = any(p.exitcode not in (None, 0) for p in context.processes)
            if not started and len(list(out.glob("rank*.started"))) == world_size:
                started, deadline = True, time.monotonic() + timeout
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        stuck = not failed and time.monotonic() > deadline
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join()
        label = f"{world_size} rank{'s' if world_size > 1 else ''}"
        # The first rank that raised in the student's file; a peer's error that follows it
        # ("Connection closed by peer") only says that a rank went away.
        mine = f'"{pathlib.Path(file).resolve()}"'
        errors = sorted(out.glob("rank*.error"), key=lambda e: (
            mine not in e.read_text(), e.stat().st_mtime))
        if errors:
            return [_exception(label, errors[0], file)]
        if stuck or not (out / "results.json").exists():
            return [_stuck(label, out, world_size, timeout)]
        return json.loads((out / "results.json").read_text())


def _exception(label, error_file, file):
    text = error_file.read_text().strip().splitlines()
    rank = error_file.stem.replace("rank", "").replace(".error", "")
    frames = [line.strip() for line in text if line.strip().startswith("File ")]
    mine = [i for i, line in enumerate(text) if f'"{pathlib.Path(file).resolve()}"' in line]
    where = (f"rank {rank}, {pathlib.Path(file).name} line "
             f"{text[mine[-1]].split(', line ')[1].split(',')[0]}: {text[mine[-1] + 1].strip()}"
             if mine else f"rank {rank}, {frames[-1] if frames else 'the grader'}")
    what = text[-1]
    if what.startswith("NotImplementedError: TODO"):
        what = f"not written yet: {what.split('TODO: ')[1]} still raises NotImplementedError"
    else:
        what = f"an exception: {what}"
    return {"check": f"{label}: the run", "passed": False, "where": where, "diagnosis": what}


def _stuck(label, out, world_size, timeout):
    said = []
    for rank in range(world_size):
        lines = (out / f"rank{rank}.collectives").read_text().splitlines() \
            if (out / f"rank{rank}.collectives").exists() else []
        last = lines[-1] if lines else "none"
        said.append(f"rank {rank} {'waits ' + last if last.startswith('in ') else 'in none'}")
    return {"check": f"{label}: the run", "passed": False, "where": "; ".join(said),
            "diagnosis": f"a collective that never completed within {timeout:g} s: a rank"
                         f" waits for peers that never join it (a collective on some ranks"
                         f" only, or in another order)"}


def report(file, name, results):
    """The text report: a line per check, its difference and diagnosis, and the verdict."""
    exercise = EXERCISES[name]
    lines = [f"minddp grade {file}: exercise {name!r} (minddp/{exercise.lesson}.py) against"
             f" {exercise.against}"]
    for r in results:
        lines.append(f"  {r['check']}: {'passed' if r['passed'] else 'FAILED'}"
                     + (f" ({r['where']})" if r["passed"] and r["where"] else ""))
        if not r["passed"]:
            lines += [f"      at:        {r['where']}", f"      diagnosis: {r['diagnosis']}"]
    passed = sum(r["passed"] for r in results)
    lines.append(f"verdict: {passed} of {len(results)} checks passed"
                 + (": every one, bit for bit" if passed == len(results) else ""))
    return "\n".join(lines)


def main(argv=None):
    from ..run.errors import exit_on_usage_error
    args = parse(argv)
    file = pathlib.Path(args.file)
    with exit_on_usage_error():
        name = exercise_of(file, args.exercise)
        ranks = args.ranks or EXERCISES[name].ranks
        bad = [r for r in ranks if r not in EXERCISES[name].allowed]
        if bad:
            raise UsageError(f"--ranks {bad[0]}: exercise {name!r} is checked at"
                             f" {', '.join(map(str, EXERCISES[name].allowed))} ranks",
                             hint=f"--ranks {' '.join(map(str, EXERCISES[name].ranks))}")
        try:
            student = load(file, EXERCISES[name].lesson)
        except Exception:  # it does not import: each rank reports where, below
            student = None
        if student is not None:
            check_signatures(student, name)
    results = []
    for world_size in ranks:
        results += run_world(file, name, world_size, args.timeout)
    if args.json:
        print(json.dumps({"file": str(file), "exercise": name, "ranks": list(ranks),
                          "passed": all(r["passed"] for r in results), "checks": results},
                         indent=1))
    else:
        print(report(file, name, results))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
