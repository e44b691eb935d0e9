"""Test helpers: start ranks (in-process spawn, or torchrun), always under a hard time limit.

A distributed bug's usual symptom is a hang: one rank waits in a collective that a
peer never joins. Every helper here kills what it started at its bound and fails the
test, so CI reports the hang instead of blocking. The bound is against a true hang only,
never a measure of speed: HANG_S is far beyond what any run takes on a loaded 2-core
machine (where importing torch alone took 17 s), and a test that waits for something
waits for the event itself (a line printed, a process ended), not for a guessed time.
"""

import contextlib
import faulthandler
import importlib.util
import io
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minddp.run import older_torch, warm  # noqa: F401  (older_torch: stock's stages, 2.11)
from minddp.launch.teardown import ddp_teardown, group_threads

REPO = Path(__file__).resolve().parent.parent
HANG_S = 600  # a run still going after this long is hung (the slowest takes ~40 s, loaded)
# Two cores here: one intra-op thread per rank keeps ranks from fighting over them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


_OUT_DIR = None  # a rank's folder of results: where the shared spawn notes its progress


def _entry(fn, rank, world_size, store_file, out_dir, args, gpu, environ):
    global _OUT_DIR
    _OUT_DIR = out_dir
    # A crash in C++ (a segfault in a kernel or in gloo) leaves no traceback: this file gets
    # every thread's Python stack instead, for the failure message.
    fault = open(os.path.join(out_dir, f"rank{rank}.fault"), "w")
    faulthandler.enable(file=fault, all_threads=True)
    try:
        # The environment of the test that started the rank, not the one the fork server
        # started with: what a spawned rank would see.
        os.environ.clear()
        os.environ.update(environ)
        if not gpu:
            # These tests mean CPU and gloo: on a GPU machine too (CUDA starts lazily, so
            # hiding it here, before any CUDA call, is in time).
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)
        # (minddp.launch.start, imported above, imported torch._dynamo before any group: launch/start.py)
        # A file store: no TCP port, so concurrent test runs never collide.
        dist.init_process_group("gloo", init_method=f"file://{store_file}",
                                rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        partial = os.path.join(out_dir, f"rank{rank}.partial")
        torch.save(result, partial)
        os.replace(partial, os.path.join(out_dir, f"rank{rank}.pt"))  # all or nothing
        del result  # fn's models are gone with its frame; nothing may hold the group now
        ddp_teardown()
        # A group that outlived its destroy could hang or abort this process's exit. (A gloo
        # thread may take a moment to end after its group is freed: a leak is one that stays.)
        deadline = time.monotonic() + 10
        while group_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_threads(), f"gloo threads after ddp_teardown(): {group_threads()}"
        Path(out_dir, f"rank{rank}.done").touch()  # finished: only interpreter exit is left
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        sys.exit(1)


CRASHES = (-signal.SIGSEGV, -signal.SIGBUS)  # a rank's exit code when native code crashed


class Crashed(RuntimeError):
    """A rank died of SIGSEGV or SIGBUS: a crash inside native code (torch, gloo), which
    no check of ours raises; its message holds the rank's Python stacks (faulthandler)."""


def run_ranks(fn, world_size, *args, timeout=HANG_S, gpu=False, environ=None, stop=None):
    """Run fn(rank, world_size, *args) on `world_size` spawned gloo ranks; return [result per rank].

    fn must be a module-level function (it is pickled by name). A rank that fails
    ends all of them at once; so does the deadline. CUDA is hidden unless gpu=True. The ranks
    see `environ`, or this process's environment now. Once the event `stop` is set, the
    ranks are killed.
    """
    ctx = warm.context()  # forked from a server that has torch imported (minddp/run/warm.py)
    with tempfile.TemporaryDirectory() as tmp:
        done = [Path(tmp, f"rank{r}.done") for r in range(world_size)]
        store = os.path.join(tmp, "store")
        environ = dict(os.environ) if environ is None else environ
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, tmp, args, gpu,
                                                     environ))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline, progress = time.monotonic() + timeout, set()
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) and not d.exists() for p, d in zip(procs, done)):
                    break  # one rank failed: the others would wait for it forever
                noted = set(Path(tmp).glob("*.progress"))
                if noted - progress:  # a shared spawn finished one more function: the bound
                    progress, deadline = noted, time.monotonic() + timeout  # is per function
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout}s (a hang?)")
                if stop is not None and stop.is_set():  # (a spawn in the background)
                    raise RuntimeError("stopped: the test session ended while these ranks ran")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        failed = []
        for r, (p, d) in enumerate(zip(procs, done)):
            err, fault = Path(tmp, f"rank{r}.err"), Path(tmp, f"rank{r}.fault")
            if p.exitcode != 0:
                said = (err.read_text() if err.exists() else "") + (
                    fault.read_text() if fault.exists() else "")
                failed.append(f"rank {r} exit code {p.exitcode}{_running(tmp, r, fn, args)}\n{said}")
        if failed:
            crashed = any(p.exitcode in CRASHES for p in procs)
            raise (Crashed if crashed else RuntimeError)("a rank failed:\n" + "\n".join(failed))
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _running(tmp, rank, fn, args):
    """' in NAME' for a shared spawn's rank: the registered function it had begun."""
    if fn is not _run_shared:
        return ""
    begun = len(list(Path(tmp).glob(f"rank{rank}.*.progress")))
    names = list(args[0])
    return f" in {names[begun]}" if begun < len(names) else " after the last function"


# One spawn per world size for the test modules that register their work here: starting
# ranks (each imports torch) costs seconds, the work itself often less. A registered function
# that raises (on every rank alike, as a bug or a failed check does) fails only the tests that
# ask for its result, with its traceback; the spawn goes on with the next function. One that
# leaves a peer waiting in a collective still ends the whole spawn, at its bound. The spawn's
# outcome, results or failure, is kept: a second test asking for it does not start it again.
_SHARED, _SHARED_RESULTS, _SELECTED = {}, {}, None
# The spawns a session will ask for run in a thread of their own from the start (conftest:
# start_shared_spawns), one world size after the other, while the tests that start no spawn
# run: those wait on a torchrun agent or a worker importing torch with a core idle. A test
# asking for a spawn still running waits for it. {world_size: set when its outcome is in}
_BACKGROUND, _CRASHES_SAID = {}, {}
# Their ranks keep the usual priority. At nice 10, quiet, the suite took 465-560 s in four
# runs on two days, at the usual priority 497-596 s in six: no gain the machine's own pace
# does not cover; and beside two busy loops, at nice 10, the last tests still waited on the
# starved spawns at 28 minutes.


def share_spawn(fn, world_sizes, *args, key=""):
    """Register fn(rank, world_size, *args) to run in the spawn that every test module shares
    at each of `world_sizes` (call at import: the spawn starts with the first result asked,
    or in the background from the start of the session). `key` tells apart two registrations
    of one function with other arguments."""
    for world_size in world_sizes:
        _SHARED.setdefault(world_size, {})[_name(fn, key)] = (fn, args)


def select_modules(modules):
    """Run only the registered work of these test modules (conftest: the tests selected)."""
    global _SELECTED
    _SELECTED = set(modules)


def _work(world_size):
    return {name: entry for name, entry in _SHARED.get(world_size, {}).items()
            if _SELECTED is None or entry[0].__module__ in _SELECTED}


def _outcome(world_size, said=None, **run):
    try:
        return spawn_shared(world_size, _work(world_size), said, **run)
    except Exception as failure:  # kept: every test of this spawn reports it, none reruns it
        return failure


def start_shared_spawns(world_sizes):
    """Run the shared spawns of `world_sizes`, in this order, in a thread; return it. They
    see this process's environment of now, whatever a test sets later."""
    warm.context(start=True)  # the fork server, started once, here
    environ, stop = dict(os.environ), threading.Event()
    for world_size in world_sizes:
        _BACKGROUND[world_size] = threading.Event()

    def spawns():
        for world_size in world_sizes:
            try:
                if not stop.is_set():
                    said = _CRASHES_SAID.setdefault(world_size, [])
                    _SHARED_RESULTS[world_size] = _outcome(
                        world_size, said, environ=environ, stop=stop)
            finally:
                _BACKGROUND[world_size].set()
    thread = threading.Thread(target=spawns, name="shared spawns", daemon=True)
    thread.stop = stop
    thread.start()
    return thread


def stop_shared_spawns(thread):
    """At the session's end: a spawn still running (its tests deselected or not reached, as
    after -x or Ctrl-C) is killed, those not begun never start: no rank outlives the session."""
    thread.stop.set()
    thread.join()


def shared_results(fn, world_size, key=""):
    """[fn's result on each rank], from the shared spawn of `world_size` ranks."""
    if world_size in _BACKGROUND:
        _BACKGROUND[world_size].wait()
        for note in _CRASHES_SAID.pop(world_size, []):  # said here, in the test that reads it
            warnings.warn(note, RuntimeWarning)
    if world_size not in _SHARED_RESULTS:
        _SHARED_RESULTS[world_size] = _outcome(world_size)
    results = _SHARED_RESULTS[world_size]
    if isinstance(results, Exception):
        raise RuntimeError(f"the shared spawn of {world_size} ranks failed") from results
    outcomes = [out[_name(fn, key)] for out in results]
    for rank, (ok, value) in enumerate(outcomes):
        if not ok:
            raise AssertionError(f"{_name(fn, key)} raised on rank {rank} of {world_size}:\n{value}")
    return [value for _, value in outcomes]


def spawn_shared(world_size, work, said=None, **run):
    """run_ranks(_run_shared, ...), once more if a rank crashed in native code. One native
    crash of a rank in a CI run (SIGSEGV, with no Python error on any rank) would otherwise
    fail some hundred tests whose checks all ran right; the crash is not hidden: a warning
    in pytest's summary carries its function and stacks (from a spawn in the background, the
    note goes into the list `said`, and the first test reading its results warns). A second
    crash, or any other failure (a check, a hang), fails the spawn's tests as before. `run`:
    run_ranks' keywords."""
    try:
        return run_ranks(_run_shared, world_size, work, **run)
    except Crashed as crash:
        note = (f"the shared spawn of {world_size} ranks crashed in native code and ran"
                f" again:\n{crash}")
        if said is None:
            warnings.warn(note, RuntimeWarning)
        else:  # a thread's warning would land in whichever test runs meanwhile, or nowhere
            said.append(note)
    return run_ranks(_run_shared, world_size, work, **run)


def _name(fn, key):
    return f"{fn.__module__}.{fn.__name__}{'/' + key if key else ''}"


def _run_shared(rank, world_size, work):
    out = {}
    for name, (fn, args) in work.items():  # the same order on every rank
        try:
            out[name] = (True, fn(rank, world_size, *args))
        except Exception:  # this function's tests fail with it; the others still run
            out[name] = (False, traceback.format_exc())
        dist.barrier()  # each module's work ends on every rank before the next begins
        Path(_OUT_DIR, f"rank{rank}.{len(out)}.progress").touch()  # HANG_S from here on
    return out


def load_script(path):
    """An example or break-it script as a module: its __main__ blocks do not run."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed_by_main(script, env, argv, world_size):
    """script.main(env, args) on this rank for argv, checked as the script checks it: the
    lines it printed (the gradient table's own line left out)."""
    args = script.checked(script.parser().parse_args(argv), world_size)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        script.main(env, args)
    return [line for line in out.getvalue().splitlines()
            if not line.startswith("gradient table:")]


def assert_identical_tables(a, b, world_size, steps=3):
    """`minddp diff a b` must say IDENTICAL, for tables of `world_size` ranks and `steps`."""
    verdict = cli("diff", a, b)  # in this process (test_ddp.py runs the command)
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, \
        verdict.stdout + verdict.stderr
    assert f"world size {world_size}, {steps} steps" in verdict.stdout, verdict.stdout


TAG = "MINDDP_TEST_TAG"  # every process a test starts carries it, workers too


def differences_from_stock(seen, weights):
    """What differs from stock's, for minddp and for one process: seen[who] is (losses,
    gradients), weights[who] the updated weights, in one order. [] when all is equal."""
    differ = []
    for who in ("minddp", "one process"):
        if seen[who][0] != seen["stock"][0]:
            differ.append(f"{who}: losses")
        if not all(torch.equal(a, b) for a, b in zip(seen[who][1], seen["stock"][1])):
            differ.append(f"{who}: gradients")
        if not all(torch.equal(a.detach(), b.detach())
                   for a, b in zip(weights[who], weights["stock"])):
            differ.append(f"{who}: weights")
    return differ


def usage_errors(calls):
    """{what: the UsageError's message, or None if call() raised nothing} for (what, call) pairs.

    The mistakes a test provokes on spawned ranks, each caught where it is raised, so one
    spawn reports them all and each test names its own."""
    from minddp import UsageError
    said = {}
    for what, call in calls:
        try:
            call()
            said[what] = None
        except UsageError as e:
            said[what] = str(e)
    return said


def tagged_pids(tag):
    """Processes whose environment holds TAG=tag: a run's launcher, workers and orphans alike."""
    needle = f"{TAG}={tag}".encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read():
                        pids.append(int(entry))
            except OSError:
                continue  # gone, or not ours
    return pids


def kill_tagged(tag):
    """SIGKILL every process of the run. torchrun starts each worker in a session of its own,
    so killing torchrun's process group would leave a hung worker running."""
    for _ in range(10):  # a process may fork while we kill: look again until none is left
        pids = tagged_pids(tag)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


class Hang(AssertionError):
    """A run still going at its deadline; every process it started has been killed."""

    def __init__(self, message, tag, stdout, stderr):
        super().__init__(message)
        self.tag, self.stdout, self.stderr = tag, stdout, stderr


# The thread that runs launches ahead of their tests (tests/ahead.py) holds the environment
# of the session's start (whatever a test running meanwhile sets) and an event, set at the
# session's end, that kills a run still going: AHEAD.environ, AHEAD.stop in that thread.
AHEAD = threading.local()


def launch_environ():
    """The environment a process started now gets: the session's start's, ahead of a test."""
    return getattr(AHEAD, "environ", os.environ)


def stopped():
    """Whether this thread runs launches ahead and the session has ended."""
    return getattr(AHEAD, "stop", threading.Event()).is_set()


class Silence:
    """A bound on a run's silence, not on its whole: expired() once none of `files` (paths, or
    open files) has grown for `limit` s, or after `whole` s in all. A busy machine slows a run
    that keeps writing (test_elastic's two agents: 59 s quiet, 389 s beside the suite and two
    busy loops at load 32); a hung one writes nothing."""

    def __init__(self, files, limit=HANG_S, whole=None, clock=time.monotonic):
        self.files, self.limit, self.clock = files, limit, clock  # clock: a test's own
        self.start = self.since = clock()
        self.whole, self.size = 3 * limit if whole is None else whole, None

    def expired(self):
        now = self.clock()
        size = sum(os.fstat(f.fileno()).st_size if hasattr(f, "fileno") else
                   os.path.getsize(f) if os.path.exists(f) else 0 for f in self.files)
        if size != self.size:
            self.size, self.since = size, now
        return now - self.since > self.limit or now - self.start > self.whole

    def __str__(self):
        return f"{self.limit}s without output or {self.whole}s in all"


def run(cmd, timeout=HANG_S, env=None, gpu=False, until=()):
    """Run a command under a hard bound on its silence (Silence: `timeout` s without a byte
    of output, or 3 x `timeout` in all); at the bound kill all it started and raise Hang.

    until: lines of output to wait for; once all are printed, everything the run started is
    killed and the result returned with .killed True (how a test watches a run that would
    otherwise never end). Output goes to files, not pipes: a worker that outlives its
    launcher may hold a pipe open forever, and reading it would block; a file is read any
    time. CUDA is hidden from the command unless gpu=True: the suite means CPU and gloo.
    """
    tag = uuid.uuid4().hex
    full_env = dict(launch_environ(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if not gpu:
        full_env["CUDA_VISIBLE_DEVICES"] = ""
    full_env[TAG] = tag
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, text=True, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        silence, timed_out, killed = Silence([out, err], timeout), False, False
        try:
            while proc.poll() is None:
                if until and all(line in _read(out) for line in until):
                    killed = True  # every awaited line is out: the event, not a deadline
                    break
                if silence.expired() or stopped():
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            kill_tagged(tag)  # at the bound or the event everything; after a normal end, orphans
            proc.wait()
        stdout, stderr = _read(out), _read(err)
    if timed_out:
        why = "the session ended" if stopped() else f"{silence} (a hang?)"
        raise Hang(f"{' '.join(map(str, cmd))} still running after {why}; killed"
                   f"\n{stdout[-2000:]}\n{stderr[-2000:]}", tag, stdout, stderr)
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    result.killed, result.tag = killed, tag
    return result


def cli(*argv, timeout=HANG_S):
    """`minddp ARGV` run in this process, as a CompletedProcess (returncode, stdout,
    stderr): no interpreter to start, no torch to import again, and the ranks of a grade or
    a benchmark fork from this process's fork server (run/warm.py), already warm. The
    command bounds its own ranks (the grader's --timeout, the benchmarks' group timeout);
    SIGALRM bounds the command itself. What a rank prints goes to this process's own file
    descriptors, not into the result: a test that reads a rank's lines runs the command in a
    process (run), as test_grade.py, test_exit.py and test_bench.py do for each kind."""
    from minddp.__main__ import main
    out, err = io.StringIO(), io.StringIO()

    def hung(signum, frame):
        raise Hang(f"minddp {' '.join(map(str, argv))} still running after {timeout}s (a"
                   f" hang?)\n{out.getvalue()[-2000:]}\n{err.getvalue()[-2000:]}", None,
                   out.getvalue(), err.getvalue())
    argv_before, alarm_before = sys.argv, signal.signal(signal.SIGALRM, hung)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            # runpy runs the command's module afresh as __main__, though a test imported it
            warnings.filterwarnings("ignore", "'minddp.", RuntimeWarning)
            try:
                code = main(list(map(str, argv)))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            except Hang:
                raise
            except Exception:  # as a process would end: its traceback, status 1
                traceback.print_exc()
                code = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm_before)
        sys.argv = argv_before
    return subprocess.CompletedProcess(["minddp", *map(str, argv)], code, out.getvalue(),
                                       err.getvalue())


def _read(file):
    file.flush()
    file.seek(0)
    return file.read()


def free_port():
    """A TCP port on 127.0.0.1 that no one holds now (the OS's pick): a rendezvous or a
    MASTER_PORT for a test's launch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_worker(script, argv, environ, out_file, err_file):
    """One worker as torchrun starts it: torchrun's environment, sys.argv, the script run as
    __main__, its output unbuffered into the run's files (as PYTHONUNBUFFERED=1 gives)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))  # read at torch's import, there
    for fd, name in ((1, out_file), (2, err_file)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    sys.argv, sys.path[0] = [str(script), *argv], str(Path(script).parent)
    faulthandler.enable(all_threads=True)  # a crash in C++ leaves its Python stacks in stderr
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code not in (None, 0):
            if not isinstance(code, int):
                print(code, file=sys.stderr)
            sys.exit(code if isinstance(code, int) else 1)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def warm_torchrun(nproc, script, *args, timeout=HANG_S):
    """What `torchrun --standalone --nproc_per_node=N script args` runs, with ranks forked warm
    (run/warm.py): each worker gets the environment torchrun's agent gives it (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, ...) and runs the script as __main__; their output goes to one
    stdout and one stderr, as under torchrun. Only the agent is missing, and with it the
    interpreter's start, torch's import and the interpreter's exit: a run of a test that
    compares what the script computes, not how torchrun starts and ends it (torchrun() does).
    For minddp's scripts, which end their group with ddp_teardown(): a script that destroys
    the group under a live stock DDP (the lesson's own) can block as the reducer is freed,
    where a fresh interpreter would have exited, so it runs under torchrun().
    The result: returncode (0, or the first failed rank's), stdout, stderr."""
    port, ctx = free_port(), warm.context()
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
                TORCHELASTIC_USE_AGENT_STORE="False")
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        for file in (out, err):
            file.touch()
        procs = [ctx.Process(target=_torchrun_worker, args=(
            script, list(map(str, args)), dict(base, RANK=str(r), LOCAL_RANK=str(r),
                                               ROLE_RANK=str(r)), str(out), str(err)))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        silence, timed_out = Silence([out, err], timeout), False
        try:
            while any(p.is_alive() for p in procs) and not timed_out:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # one worker failed: torchrun stops the others
                timed_out = silence.expired()
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        stdout, stderr = out.read_text(), err.read_text()
    cmd = ["torchrun", f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    if timed_out:
        raise Hang(f"{' '.join(cmd)} (warm) still running after {silence} (a hang?); killed\n"
                   f"{stdout[-2000:]}\n{stderr[-2000:]}", None, stdout, stderr)
    code = next((p.exitcode for p in procs if p.exitcode != 0), 0)
    return subprocess.CompletedProcess(cmd, 1 if code < 0 else code, stdout, stderr)


def torchrun(nproc, script, *args, timeout=HANG_S, launcher=(), gpu=False, until=()):
    """`torchrun --standalone --nproc_per_node=N [launcher] script args`: --standalone picks a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *launcher, str(script), *map(str, args)]
    return run(cmd, timeout=timeout, gpu=gpu, until=until)
