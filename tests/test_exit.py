"""A finished run exits, a bad flag fails before training, and a hung run cannot hang the tests.

    pytest tests/test_exit.py

The stress check behind the teardown order (many runs under CPU load) is
tests/scripts/stress_exit.py, run on demand; its counts are in docs/failures.md.
"""

import contextlib
import faulthandler
import io
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ahead import ahead, ahead_torchrun
from helpers import HANG_S, REPO, Hang, kill_tagged, run, run_ranks, tagged_pids, torchrun
from minddp import GradTable, ManualDDP, ddp_teardown
from minddp.launch.teardown import group_threads, let_go_of_groups, stock_leaked_meshes

EXAMPLES = REPO / "examples"


def _train_and_gather(rank, world_size, wrapper):
    # What the examples do before teardown: a DDP model, a backward, the table's gather.
    model = {"stock": DDP, "manual": ManualDDP}[wrapper](torch.nn.Linear(3, 2))
    table = GradTable(model, "unused")
    model(torch.ones(4, 3)).sum().backward()
    table.record()
    table.gather()
    return True  # model and table die with this frame, before _entry's ddp_teardown()


@pytest.mark.parametrize("wrapper", ["stock", "manual"])
def test_teardown_after_the_model_is_freed_leaves_no_gloo_thread(wrapper):
    # run_ranks' _entry calls ddp_teardown() after fn returns, then asserts that no gloo
    # thread is left: the group died inside destroy_process_group(), not at exit.
    assert run_ranks(_train_and_gather, 2, wrapper) == [True, True]


def _teardown_with_the_model_alive(rank, world_size):
    model = DDP(torch.nn.Linear(3, 2))
    model(torch.ones(4, 3)).sum().backward()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ddp_teardown()  # the lesson's place: at the end of main(), the model still alive
    lingering = group_threads()
    faulthandler.cancel_dump_traceback_later()  # the bound it armed: this test exits on its own
    return out.getvalue(), lingering


def test_teardown_with_a_live_ddp_model_says_so_and_bounds_the_exit():
    for message, lingering in run_ranks(_teardown_with_the_model_alive, 2):
        assert lingering, "the live DDP model should still hold the group"
        assert "warning: the process group outlived ddp_teardown()" in message
        assert "call ddp_teardown() after the function that holds the model has returned" in message
        assert "exiting within 60 s" in message


def _stock_tp_step():
    # One step of a model split by stock's parallelize_module: on torch 2.11 and 2.12 its
    # DTensor dispatch keeps (from C++) the specs it saw, their mesh and so the group.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as stock_tp
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    stock_tp.parallelize_module(model, init_device_mesh("cpu", (2,)),
                                {"0": stock_tp.ColwiseParallel(), "2": stock_tp.RowwiseParallel()})
    model(torch.ones(5, 3)).sum().backward()
    return model


def _teardown_after(rank, world_size, kept):
    # kept: what the program still holds at teardown, its own leak: nothing, the TP model
    # itself, or a DDP model beside the freed TP model's leftovers.
    alive = [_stock_tp_step()]
    if kept != "tp model":
        alive.clear()  # the TP model freed: what stock keeps of it stays (torch < 2.13)
    if kept == "ddp model":
        alive.append(DDP(torch.nn.Linear(3, 2)))
    if kept == "a mesh with no group":  # as torch 2.12's decomposition tracer keeps: it holds
        from torch.distributed.device_mesh import DeviceMesh  # nothing, so no leak of anyone's
        alive.append(DeviceMesh("cpu", [0], _init_backend=False, _rank=0))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ddp_teardown()
    lingering = group_threads()
    faulthandler.cancel_dump_traceback_later()  # a bound it may have armed: exit on our own
    del alive
    for mesh in stock_leaked_meshes():  # torch < 2.13: what stock kept of the TP model holds
        let_go_of_groups(mesh)  # the group; let go, so that the spawn's own check passes
    return out.getvalue(), lingering


@pytest.mark.parametrize("kept", ["nothing", "a mesh with no group"])
def test_stocks_own_leak_is_named_in_one_line_with_the_torch_version(kept):
    # Torch 2.11 and 2.12: the mesh stock's DTensor leaked lets go of the group, which dies
    # inside destroy_process_group() as on 2.13, and teardown says whose leak it was, once.
    # A mesh made without a group (torch 2.12's decomposition tracer keeps one) holds none:
    # the program may keep it and stock's leak is still stock's.
    (said, lingering), (said_1, lingering_1) = run_ranks(_teardown_after, 2, kept)
    assert lingering == lingering_1 == [] and said_1 == ""
    if torch.__version__ < "2.13":
        assert said == (f"note: stock's DTensor (torch {torch.__version__}) leaked 1 device"
                        " mesh(es) holding the process group; ddp_teardown() let go of the group\n")
    else:
        assert said == ""  # 2.13 keeps nothing: nothing to name


@pytest.mark.parametrize("kept", ["tp model", "ddp model"])
def test_a_leak_of_the_programs_own_still_fails_beside_stocks(kept):
    # A live TP model holds its mesh from Python; a live DDP model holds the group itself:
    # either is the program's leak, on every torch, stock's leftovers beside it or not.
    for said, lingering in run_ranks(_teardown_after, 2, kept):
        assert lingering, f"the live {kept} should still hold the group"
        assert "warning: the process group outlived ddp_teardown()" in said
        assert "stock's DTensor" not in said


def test_a_hung_worker_is_killed_and_its_output_still_read():
    # Both workers print "finished", then never exit (a teardown hang seen from outside).
    # The helper waits for the two lines, however long a busy machine takes to print them,
    # then kills the run: every worker, though each lives in a session of its own.
    finished = ["[rank0] finished", "[rank1] finished"]
    result = torchrun(2, REPO / "tests" / "scripts" / "finish_then_sleep.py", until=finished)
    assert result.killed, "the workers exited on their own: they were meant to hang"
    assert all(line in result.stdout for line in finished)  # read, though the run never ended
    assert tagged_pids(result.tag) == []  # torchrun and both workers are gone


def test_a_hang_past_the_bound_is_killed_and_reported():
    with pytest.raises(Hang) as info:  # nothing awaited: the bound ends it, whatever it printed
        # sh, not python: its start takes milliseconds, where python's took over 5 s beside
        # the suite and two busy loops, killed before it printed (the bound is on silence)
        run(["sh", "-c", "echo started; exec sleep 600"], timeout=5)
    assert "still running after 5s without output or 15s in all (a hang?)" in str(info.value)
    assert "started" in info.value.stdout and tagged_pids(info.value.tag) == []


BAD_FLAGS = [
    ("manual_ddp.py", ["--epochs", "0"], "error: --epochs 0: must be 1 or more"),
    ("manual_ddp.py", ["--epochs", "-1"], "error: --epochs -1: must be 1 or more"),
    ("stock_ddp.py", ["--factor", "0"], "error: --factor 0: must be 1 or more"),
    ("stock_ddp.py", ["--factor", "-2"], "error: --factor -2: must be 1 or more"),
    ("accumulate.py", ["--accumulate", "0"], "error: --accumulate 0: must be 1 or more"),
    ("manual_ddp.py", ["--grad-table", "/nonexistent/dir/t.txt"],
     "error: --grad-table /nonexistent/dir/t.txt: its directory /nonexistent/dir does not exist"),
    ("restart.py", ["--checkpoint", "/nonexistent/dir/ck.pt"],
     "error: --checkpoint /nonexistent/dir/ck.pt: its directory /nonexistent/dir does not exist"),
    ("stock_ddp.py", ["--grad-table", "/proc/t.txt"],
     "error: --grad-table /proc/t.txt: its directory /proc is not writable"),
    ("manual_ddp.py", ["--grad-table", "/tmp"], "error: --grad-table /tmp: is a directory"),
    ("manual_ddp.py", ["--accumulate", "2"],
     "error: --accumulate is not a flag of this example: it lives in examples/accumulate.py"),
    ("stock_ddp.py", ["--checkpoint", "ck.pt"],
     "error: --checkpoint is not a flag of this example: it lives in examples/restart.py"),
    ("zero1.py", ["--timeline", "z.json"],  # a flag of another example, named
     "error: --timeline is not a flag of this example: it lives in examples/manual_ddp.py"),
    ("manual_ddp.py", ["--timeout", "0"], "error: --timeout 0: must be more than 0 seconds"),
    ("restart.py", ["--checkpoint", "ck.pt", "--timeout", "-1"],
     "error: --timeout -1: must be more than 0 seconds"),
]


@pytest.mark.parametrize("script,flags,message", BAD_FLAGS, ids=[" ".join(f) for _, f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_and_a_hint_before_training(script, flags, message):
    result = run([sys.executable, str(EXAMPLES / script), *flags])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith(message) and lines[1].startswith("---> HINT: "), result.stderr
    assert len(lines) == 2 and "Epoch" not in result.stdout  # nothing trained
    assert not (REPO / "ck.pt").exists()


def test_no_directory_is_created_behind_the_users_back(tmp_path):
    result = run([sys.executable, str(EXAMPLES / "manual_ddp.py"), "--grad-table",
                  str(tmp_path / "new" / "t.txt")])
    assert result.returncode == 2 and not (tmp_path / "new").exists()


TYPO = ahead_torchrun(2, EXAMPLES / "manual_ddp.py", "--grad-tabel", "t.txt")


def test_a_typo_is_refused_once_under_torchrun_with_the_nearest_flag():
    result = TYPO.result()
    assert result.returncode == 1  # torchrun's own status for any failed worker (docs/failures.md)
    ours = [line for line in result.stderr.splitlines()  # less torchrun's own log lines
            if not re.match(r"[WEI]\d{4} |\*+$", line)]
    assert ours[0] == "error: unrecognized argument '--grad-tabel'", result.stderr  # ours first
    assert ours[1].startswith("---> HINT: did you mean --grad-table?")
    assert result.stderr.count("error: unrecognized argument '--grad-tabel'") == 1  # rank 0 only
    # torchrun's report: the worker that failed first said 2; torchrun then stops the other,
    # which says 2 itself only if it got there first (a race that load decides: not asserted).
    statuses = re.findall(r"exitcode\s*: (-?\d+)", result.stderr)
    assert "2" in statuses and set(statuses) <= {"2", "-15"}, statuses
    assert "usage:" not in result.stderr


def test_ctrl_c_ends_a_run_with_one_line_and_status_130(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, str(EXAMPLES / "manual_ddp.py"), "--epochs",
                                 "100000"], cwd=REPO, stdout=o, stderr=e,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + HANG_S  # a bound against a hang, not a speed
            while "Epoch:" not in out.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)  # training has started (an event, however long it takes)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=HANG_S) == 130
        finally:
            proc.kill()
    assert err.read_text() == "[rank0] interrupted\n"


def _three_runs(tmp):
    """restart.py to its end, the same command again, then with a larger --epochs."""
    args = [sys.executable, str(EXAMPLES / "restart.py"), "--checkpoint", str(tmp / "ck.pt"),
            "--grad-table", str(tmp / "t.txt")]
    return run(args), run(args), run(args + ["--epochs", "4"])


FINISHED = ahead(_three_runs)


def test_a_finished_checkpoint_says_so_and_trains_nothing_more():
    (first, again, more), ck = FINISHED.result(), FINISHED.tmp / "ck.pt"
    assert first.returncode == 0, first.stderr
    assert again.returncode == 0, again.stderr
    assert f"{ck} holds a finished run (3 epochs): nothing left to train" in again.stdout
    assert "Epoch:" not in again.stdout and "Test accuracy 1.0" in again.stdout
    assert "resuming" not in again.stdout  # one line says what the checkpoint holds
    assert more.returncode == 0, more.stderr  # a larger --epochs trains on
    assert "resuming from" in more.stdout and "Epoch: 004/004" in more.stdout
    assert "Epoch: 003/004" not in more.stdout


def test_version_names_minddp_and_torch_without_importing_torch():
    result = run([sys.executable, "-X", "importtime", "-m", "minddp", "--version"])
    assert result.returncode == 0
    assert re.fullmatch(r"minddp \S+, torch \S+\n", result.stdout), result.stdout
    # importtime's lines name every module imported, one a line: torch is not among them
    assert not re.search(r"\|\s+torch$", result.stderr, re.M)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid} (gone)"


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def test_ctrl_c_in_a_benchmark_is_one_line_and_leaves_no_rank(tmp_path):
    # Ctrl-C as a terminal sends it, to the whole process group: the launcher and its
    # spawned ranks. Pressed again each second until the run ends (a press that lands while
    # the ranks are being started is ignored there, as the ranks ignore it throughout).
    err = tmp_path / "err"
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               MINDDP_TEST_TAG=tag)
    with open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "minddp", "bench", "--sizes", "0.3M",
                                 "--world-sizes", "2", "--rounds", "100000"], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=e, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + HANG_S  # a bound against a hang, not a speed
            while "one spawn per world size" not in err.read_text():
                assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
                time.sleep(0.1)
            while proc.poll() is None and time.monotonic() < deadline:
                os.killpg(proc.pid, signal.SIGINT)
                time.sleep(1)
            assert proc.wait(timeout=HANG_S) == 130
            # Every rank ended with it: a rank is a child of the fork server, itself tagged.
            left = tagged_pids(tag)
            ranks = [pid for pid in left if _parent(pid) in left]
            assert ranks == [], [_cmdline(pid) for pid in ranks]
            # The fork server and multiprocessing's resource tracker leave once they read
            # that the launcher is gone: on a busy machine, a moment later.
            deadline = time.monotonic() + HANG_S  # a bound against a hang, not a speed
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = tagged_pids(tag)
            assert left == [], [_cmdline(pid) for pid in left]
        finally:
            kill_tagged(tag)
    text = err.read_text()
    assert text.endswith("[rank0] interrupted\n") and "Traceback" not in text, text
