"""Running a student's checks on ranks: started here, under a time limit, failures read back.

    minddp grade exercises/naive.py      # grade.py calls run_world once per world size

One group of gloo ranks per world size, each loading the student's file as its lesson and
running the exercise's checks (checks/). Two failures are read
back instead of results: a rank that raised (the first one whose traceback passes through
the student's file: its line there), and ranks still running past the time limit, counted
from the moment all of them have joined the group (a slow torch import is no hang): each
rank notes every collective it enters and leaves, with its ordinal on its group, so the
report says where each one waits; and ranks are stopped at once, whatever the time limit,
when two of them are inside the same call of a group called unlike (mismatch.certain).
"""

import faulthandler
import json
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback

from ...run import warm
from ..exercises import EXERCISES
from . import mismatch

STARTING_S = 600  # the most a rank may take to import torch and join the group
# What a rank raises when a peer went away (it finished, or died): never the diagnosis. The
# peer's own error says why, or, if it has none, the rank was waiting for a collective that
# never completed: the same report as a rank still waiting at the time limit, whichever
# rank notices first.
# torch's errors whose cause lies far from where they are raised: what usually causes them
# An error raised far from its cause, and its usual cause: (exercise or None for any, words of
# the error, the cause).
HINTS = [(None, "modified by an inplace operation", "a tensor autograd saved for the backward"
          " was changed in place after the forward used it (e.g. a gathered weight refilled with"
          " copy_ while the graph still holds it): fill it through .data, or make a new tensor"),
         (None, "is not part of group", "src and dst are global ranks: the rank that is r in"
          " the group is dist.get_global_rank(group, r)"),
         ("fsdp", "must match the size of tensor b", "a gradient and its parameter's shard"
          " differ in rows: each rank's gradient must be its own rows of the whole gradient,"
          " torch.chunk's block (ceil(rows / W) a rank, the last shorter, no padding left)"),
         ("fsdp", "Trying to resize storage that is not resizable", "unshard ran again on"
          " weights already whole: it returns at once while is_unsharded, and sets it at its"
          " end")]
# where a collective was called from when not from the student's file: never read as their cause
NOT_THEIRS = ("the grader, gathering the results", "stock's code")
GRADER = pathlib.Path(__file__).parents[1]  # minddp/grader/: a call from its files is the grader's
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _record_collectives(path, student_file):
    """Note each collective this rank enters and leaves, with the student's line that led
    there, in `path`: what a rank stuck past the timeout was waiting in."""
    import torch.distributed as dist

    from .mismatch import details
    from ..shared.training import COLLECTIVES
    log = open(path, "a", buffering=1)
    calls = {}  # per group: how many collectives this rank has entered on it

    def wrap(name, original):
        def call(*args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            ours = any(GRADER in pathlib.Path(f.filename).parents for f in stack[-3:])
            where = next((f"{pathlib.Path(f.filename).name} line {f.lineno}"
                          for f in reversed(stack) if f.filename == student_file),
                         NOT_THEIRS[0] if ours else NOT_THEIRS[1])
            noted = details(original, args, kwargs)
            if name not in mismatch.P2P:  # the ordinal of this call on its group
                key = repr(noted.get("group"))
                noted["call"] = calls[key] = calls.get(key, -1) + 1
            # how it was called, for a hang's diagnosis (mismatch.py), after a tab
            log.write(f"in {name} ({where})\t{json.dumps(noted)}\n")
            result = original(*args, **kwargs)
            log.write("done\n")
            return result
        return call
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    new_group = dist.new_group

    def noted_group(ranks=None, *args, **kwargs):
        log.write(f"group\t{json.dumps(sorted(ranks) if ranks is not None else None)}\n")
        return new_group(ranks, *args, **kwargs)
    dist.new_group = noted_group


def _rank(rank, world_size, file, name, tmp, environ, timeout):
    import torch
    import torch.distributed as dist
    out = pathlib.Path(tmp)
    try:
        os.environ.clear()  # the grader's environment now, not the fork server's (run/warm.py)
        os.environ.update(environ)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, on any machine
        torch.set_num_threads(1)
        from ...launch.teardown import ddp_teardown
        from ..student import load
        # Before the group exists: the checks import stock's references, and importing
        # torch.distributed.optim after init_process_group keeps the group alive past destroy.
        from ..checks import CHECKS
        dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank,
                                world_size=world_size)
        (out / f"rank{rank}.started").touch()  # the time limit counts from here
        # Where this rank is just before the limit, should it still run then: every
        # thread's stack, into a file (a C thread writes it: no GIL needed).
        stack = open(out / f"rank{rank}.stack", "w")
        faulthandler.dump_traceback_later(max(timeout - 0.5, timeout * 0.9), file=stack)
        _record_collectives(out / f"rank{rank}.collectives", str(pathlib.Path(file).resolve()))
        student = load(pathlib.Path(file), EXERCISES[name].lesson)
        results = CHECKS[name](student, rank, world_size)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            (out / "results.json").write_text(json.dumps(results))
        del student
        ddp_teardown()
    except BaseException:
        whole(out / f"rank{rank}.error", traceback.format_exc())
        sys.exit(1)


def whole(path, text):
    """Write `text` to `path` whole or not at all: a rank killed at the limit while writing
    (a peer's "Connection closed" raised as the ranks are killed) leaves only `path`.part,
    which the report never reads, not the first part of a traceback or an empty file."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)  # (a rename: the file appears with all of its text)


def run_world(file, name, world_size, timeout):
    """The checks at one world size: [result], or one failed result naming the exception or
    the collective the ranks were stuck in."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        warm.context()  # the ranks forked from a server that has torch imported (run/warm.py)
        context = mp.start_processes(_rank, args=(world_size, str(file), name, tmp,
                                                  dict(os.environ), timeout),
                                     nprocs=world_size, start_method="forkserver", join=False)
        out, failed = pathlib.Path(tmp), False
        deadline = time.monotonic() + STARTING_S  # (torch's import may take a while)
        started, certain = False, False
        while not all(p.exitcode is not None for p in context.processes):
            failed = any(p.exitcode not in (None, 0) for p in context.processes)
            if not started and len(list(out.glob("rank*.started"))) == world_size:
                started, deadline = True, time.monotonic() + timeout
            if failed or time.monotonic() > deadline:
                break
            # Ranks inside a collective that can never complete (mismatch.certain): they are
            # stopped now, whatever the time limit.
            certain = started and mismatch.certain(_entered(out, world_size), world_size)
            if certain:
                break
            time.sleep(0.05)
        stuck = "certain" if certain else \
            "time" if not failed and time.monotonic() > deadline else None
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join()
        return report(out, file, name, world_size, timeout, stuck)


def _entered(out, world_size):
    """{rank: (collective, how it was called, from the student's file)} for each rank whose
    last line in its log is a collective it entered and has not left: the ends of the logs
    only (read every 50 ms)."""
    entered = {}
    for rank in range(world_size):
        try:
            with open(out / f"rank{rank}.collectives", "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
                lines = log.read().decode(errors="replace").split("\n")
        except FileNotFoundError:
            continue
        last = lines[-2] if len(lines) > 1 else ""  # (whole lines only)
        what, _, noted = last.partition("\t")
        try:
            if what.startswith("in "):
                entered[rank] = (what.split()[1], json.loads(noted), _theirs(what))
        except json.JSONDecodeError:
            continue
    return entered


def _theirs(what):
    """Whether a logged call came from the student's file (not the grader's, nor stock's)."""
    return not what.endswith(tuple(f"({where})" for where in NOT_THEIRS))


def _group(out, world_size):
    """The ranks of the group the check made last (dist.new_group), or None."""
    group = None
    for rank in range(world_size):
        path = out / f"rank{rank}.collectives"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        groups = [json.loads(line.split("\t")[1]) for line in lines
                  if line.startswith("group\t")]
        group = groups[-1] if groups else group
    return group


def report(out, file, name, world_size, timeout, stuck):
    """[the results], or one failed result, from what the ranks left in the folder `out`.
    stuck: "time" (ranks still running at the limit), "certain" (stopped as soon as their
    calls showed they never could finish), or None (they ended)."""
    label = f"{world_size} rank{'s' if world_size > 1 else ''}"
    # The first rank that raised in the student's file; a peer's error that follows it
    # ("Connection closed by peer") only says that a rank went away.
    mine = f'"{pathlib.Path(file).resolve()}"'
    errors = sorted(out.glob("rank*.error"), key=lambda e: (
        mine not in e.read_text(), e.stat().st_mtime))
    left = [e for e in errors if any(gone in e.read_text() for gone in PEER_GONE)]
    said = [e for e in errors if e not in left]
    if said:
        return [_exception(label, said[0], file, name)]
    if stuck or left or not (out / "results.json").exists():
        return [_stuck(label, out, world_size, timeout, file, stuck)]
    return json.loads((out / "results.json").read_text())


def _exception(label, error_file, file, name):
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
        what = f"an exception: {what}" + next((f" ({hint})" for exercise, said, hint in HINTS
                                               if said in what and exercise in (None, name)), "")
    return {"check": f"{label}: the run", "passed": False, "where": where, "diagnosis": what}


def _stuck(label, out, world_size, timeout, file, stuck="time"):
    said, waiting, running, waits = [], False, False, {}
    group = _group(out, world_size)
    for rank in range(world_size):
        # (whole lines only: a rank killed at the limit may have been writing its last one)
        lines = (out / f"rank{rank}.collectives").read_text().split("\n")[:-1] \
            if (out / f"rank{rank}.collectives").exists() else []
        lines = [line for line in lines if not line.startswith("group\t")]
        last, _, noted = (lines[-1] if lines else "none").partition("\t")
        if last.startswith("in "):
            waits[rank] = (last.split()[1], json.loads(noted) if noted else {}, _theirs(last))
        at = _line_in(out / f"rank{rank}.stack", file)
        waiting |= last.startswith("in ")
        running |= at is not None and not last.startswith("in ")
        said.append(f"rank {rank} waits {last}" if last.startswith("in ") else
                    f"rank {rank} {at or 'in none'}")
    elsewhere = ("a send or receive whose peer never posts its match (sizes or peers that do"
                 " not pair up), or a loop that never ends")
    within = {"certain": "can never complete", "time": f"never completed within {timeout:g} s"
              }.get(stuck, "never completed")  # (None: a rank left it, the others saw it go)
    finished = f" within {timeout:g} s" if stuck == "time" else ""
    why = (f"the ranks never finished{finished}, none of them in a collective: each runs the"
           f" line named: {elsewhere}" if not waiting else
           f"a collective that {within}: a rank waits for peers that never join it; "
           + ("the others never got past the lines named: " + elsewhere if running else
              "a collective on some ranks only, or in another order"))
    named = mismatch.why(waits, world_size, group) if waiting else None
    return {"check": f"{label}: the run", "passed": False, "where": "; ".join(said),
            "diagnosis": f"a collective that {within}: {named}" if named else why,
            "stuck": True}


def _line_in(stack_file, file):
    """'at naive.py line 7: <the line>', the innermost frame of the student's file in the
    stacks faulthandler wrote just before the limit, or None."""
    text = stack_file.read_text() if stack_file.exists() else ""
    # faulthandler's frame: File "PATH", line N in FUNCTION. Whole frames only: the ranks may
    # be killed at the limit while the stacks are still being written.
    mine = re.compile(rf'File "{re.escape(str(pathlib.Path(file).resolve()))}", line (\d+) in ')
    for frame in text.splitlines():  # each thread's, the most recent call first
        found = mine.search(frame)
        if found:
            number = int(found.group(1))
            source = pathlib.Path(file).read_text().splitlines()[number - 1].strip()
            return f"at {pathlib.Path(file).name} line {number}: {source}"
    return None
