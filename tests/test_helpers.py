"""The test helpers themselves: a shared spawn keeps one failing module's work to its tests.

    pytest tests/test_helpers.py
"""

import ctypes
import os
import signal
import sys
import time

import pytest
import torch.distributed as dist

import ahead
import helpers
from helpers import run_ranks


def _raises(rank, world_size):
    dist.barrier()  # a collective first: it fails after taking part, as real work does
    raise ValueError(f"planted on rank {rank}")


def _works(rank, world_size):
    out = [None] * world_size  # a collective after the other function's failure
    dist.all_gather_object(out, [rank])
    return out


def test_a_function_that_raises_fails_alone_and_the_spawn_goes_on():
    work = {"raises": (_raises, ()), "works": (_works, ())}
    for rank, out in enumerate(run_ranks(helpers._run_shared, 2, work)):
        ok, text = out["raises"]
        assert not ok and f"ValueError: planted on rank {rank}" in text and "Traceback" in text
        assert out["works"] == (True, [[0], [1]])


def test_its_tests_see_its_traceback_and_the_outcome_is_kept(monkeypatch):
    outcome = [{"m.f": (False, "Traceback ... ValueError: planted"), "m.g": (True, 7)}] * 2
    monkeypatch.setitem(helpers._SHARED_RESULTS, 99, outcome)
    def f(rank, world_size):
        pass

    def g(rank, world_size):
        pass
    f.__module__ = g.__module__ = "m"
    with pytest.raises(AssertionError, match="m.f raised on rank 0 of 99:\nTraceback"):
        helpers.shared_results(f, 99)
    assert helpers.shared_results(g, 99) == [7, 7]
    failure = RuntimeError("a rank failed")
    monkeypatch.setitem(helpers._SHARED_RESULTS, 98, failure)
    for _ in range(2):  # asked twice, started never: the failure is the kept outcome
        with pytest.raises(RuntimeError, match="the shared spawn of 98 ranks failed"):
            helpers.shared_results(g, 98)


def _crashes(rank, world_size, marker):
    """Rank 0 dies of SIGSEGV the first time (no marker yet), or every time (marker None)."""
    if rank == 0 and (marker is None or not os.path.exists(marker)):
        if marker is not None:
            open(marker, "w").close()
        ctypes.string_at(0)  # a read of address 0: SIGSEGV
    dist.barrier()
    return rank


def test_a_native_crash_is_run_again_once_and_warned_with_its_stack(tmp_path):
    marker = str(tmp_path / "crashed once")
    with pytest.warns(RuntimeWarning, match="(?s)crashed in native code and ran again.*rank 0"
                      " exit code -11 in test_helpers._crashes.*Segmentation fault.*_crashes"):
        out = helpers.spawn_shared(2, {"test_helpers._crashes": (_crashes, (marker,))})
    assert [o["test_helpers._crashes"] for o in out] == [(True, 0), (True, 1)]
    with pytest.warns(RuntimeWarning), pytest.raises(helpers.Crashed, match="exit code -11"):
        helpers.spawn_shared(2, {"test_helpers._crashes": (_crashes, (None,))})


def _sleeps(rank, world_size, folder):
    """Note this rank's pid, then wait far past any test: only a kill ends it."""
    open(os.path.join(folder, f"rank{rank}.pid"), "w").write(str(os.getpid()))
    time.sleep(helpers.HANG_S)


def test_a_spawn_in_the_background_is_killed_at_the_sessions_end(tmp_path, monkeypatch):
    # World sizes 5 and 6: none of the session's own spawns (those are left alone).
    work = {"test_helpers._sleeps": (_sleeps, (str(tmp_path),))}
    for registry in (helpers._SHARED, helpers._SHARED_RESULTS, helpers._BACKGROUND,
                     helpers._CRASHES_SAID):
        for world_size in (5, 6):  # set through monkeypatch: gone again after the test
            monkeypatch.setitem(registry, world_size, dict(work))
            del registry[world_size]
    monkeypatch.setitem(helpers._SHARED, 5, work)
    monkeypatch.setitem(helpers._SHARED, 6, work)
    thread = helpers.start_shared_spawns([5, 6])
    try:
        deadline = time.monotonic() + helpers.HANG_S
        while len(list(tmp_path.glob("*.pid"))) < 5:  # every rank of 5 started
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    finally:  # (a failure above leaves no rank sleeping)
        helpers.stop_shared_spawns(thread)
    assert not thread.is_alive()
    for pid in pids:  # killed and reaped (run_ranks joins them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="the shared spawn of 5 ranks failed") as failed:
        helpers.shared_results(_sleeps, 5)
    assert "stopped: the test session ended" in str(failed.value.__cause__)
    assert helpers._BACKGROUND[6].is_set() and 6 not in helpers._SHARED_RESULTS  # never begun


def test_a_launch_runs_once_whoever_asks_first_and_its_error_is_raised_again():
    calls = []

    def counted(tmp, value):
        calls.append(sorted(tmp.iterdir()))  # a folder of its own, empty
        if value is None:
            raise ValueError("planted")
        return value
    launch = ahead.ahead(counted, 7)
    assert launch.result() == 7 and launch.result() == 7 and calls == [[]]  # run in front
    failing = ahead.ahead(counted, None)
    for _ in range(2):  # each test that asks sees the traceback; it is not run again
        with pytest.raises(ValueError, match="planted"):
            failing.result()
    assert len(calls) == 2


def test_launches_ahead_see_the_sessions_environment_and_stop_at_its_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDDP_PROBE", "at the start")
    printed = ahead.ahead_run([sys.executable, "-c",
                               "import os; print(os.environ['MINDDP_PROBE'])"])
    sleepers = [ahead.ahead_run([sys.executable, "-c", "import os, time; open(os.path.join("
                                 f"{str(tmp_path)!r}, 'pid{i}'), 'w').write(str(os.getpid()));"
                                 " time.sleep(600)"]) for i in range(2)]
    never = ahead.ahead(lambda tmp: pytest.fail("a launch not begun at the end ran"))
    threads = ahead.start([printed, *sleepers, never])  # two threads: both sleepers at once
    try:
        monkeypatch.setenv("MINDDP_PROBE", "set later by a test")
        deadline = time.monotonic() + helpers.HANG_S
        pids = []
        for pid in (tmp_path / "pid0", tmp_path / "pid1"):
            while not pid.exists() or not pid.read_text():
                assert time.monotonic() < deadline and all(t.is_alive() for t in threads)
                time.sleep(0.05)
            pids.append(int(pid.read_text()))
    finally:  # (a failure above leaves no process sleeping)
        ahead.stop(threads)
    assert printed.result().stdout == "at the start\n"
    for sleeper, pid in zip(sleepers, pids):
        with pytest.raises(helpers.Hang, match="still running after the session ended; killed"):
            sleeper.result()
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(pid, 0)
    assert not never._claimed


def test_a_command_run_in_this_process_takes_ctrl_c_for_itself():
    from minddp.run.errors import interrupted
    assert helpers.cli("diff", "nowhere1", "nowhere2").returncode == 2
    assert signal.getsignal(signal.SIGINT) is interrupted  # as its own process would


def test_the_next_test_has_the_sessions_ctrl_c_back():
    # (conftest: a Ctrl-C then ends the session with its cleanup, not at once with exit 130)
    from minddp.run.errors import interrupted
    assert signal.getsignal(signal.SIGINT) is not interrupted


def test_a_run_that_keeps_writing_outlives_the_silence_bound_and_one_that_stops_does_not(tmp_path):
    """helpers.Silence bounds the silence, not the whole run: a run that writes a line each
    second goes on past 4 bounds of 2 s; once it writes nothing, it is hung one bound after
    its last line; the whole has a bound of its own. A clock of the test's own: no timing."""
    now = [0.0]
    log, other = tmp_path / "a.log", tmp_path / "b.log"  # b: not yet started, no file
    log.write_text("")
    silence = helpers.Silence([str(log), str(other)], limit=2, whole=60, clock=lambda: now[0])
    for second in range(1, 9):  # a line a second for 8 s: never expired
        now[0] = second
        with open(log, "a") as f:
            f.write("a line\n")
        assert not silence.expired(), f"expired at {second} s, mid-output"
    now[0] = 10.0  # 2 s after the last line: not yet past the bound
    assert not silence.expired()
    now[0] = 10.5
    assert silence.expired()
    other.write_text("b's first line\n")  # a file that appears counts as output too
    assert not silence.expired() and "2s without output or 60s in all" == str(silence)
    now[0] = 60.5
    other.write_text(other.read_text() + "more\n")
    assert silence.expired(), "the whole bound: a backstop, whatever was written"
