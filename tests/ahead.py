"""Launches run ahead of their tests: real processes started while other tests run.

    pytest tests/test_examples.py tests/test_faults.py

A test whose work is a launch of real processes (torchrun: its agent, then each worker,
import torch before any work; or a script) mostly leaves a core idle. Registered at import
with ahead(), such a launch runs in one of two threads from the session's start
(conftest), each taking the next launch not begun, in the order of the test files that
read them, beside the tests running in front and the shared spawns (helpers.share_spawn). A test
asks for its launch's result: it waits for the launch if a thread is running it, or runs it
itself, there and then, if no thread has reached it. What the test checks stays in the
test; a launch that raises (a hang killed at its bound) fails the tests that read it, with
its traceback.

A launch sees the environment of the session's start (whatever a test running meanwhile
sets), writes in a folder of its own (`launch.tmp`, removed at the session's end), and is
stopped at the session's end if still running (after -x or Ctrl-C): no process outlives it.
"""

import os
import shutil
import tempfile
import threading
from pathlib import Path

import helpers


class Launch:
    """fn(tmp, *args), run once: by a thread ahead, or by the first test to ask."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.tmp = None
        self._claimed, self._lock, self._done = False, threading.Lock(), threading.Event()
        self._value = self._error = None

    def _claim(self):
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def _run(self):
        try:
            self.tmp = Path(tempfile.mkdtemp(dir=_root()))
            self._value = self.fn(self.tmp, *self.args)
        except BaseException as error:  # kept: raised again in each test that asks
            self._error = error
        finally:
            self._done.set()

    def result(self):
        """fn's return value; its exception raised again."""
        if self._claim():  # not begun: this test runs it now, in front
            self._run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


_ROOT = []  # the folder of the launches' folders, made at the first launch


def ahead(fn, *args):
    """Register fn(tmp, *args) to run ahead of the tests that read it (call at a test module's
    import; keep the launch, or a dict or list of launches, in a global of the module, which
    is how conftest finds the tests that read it). tmp: an empty folder of the launch's own."""
    return Launch(fn, args)


def ahead_run(cmd, **kwargs):
    """ahead() of helpers.run(cmd, **kwargs): a command that writes nowhere a test reads."""
    return Launch(lambda tmp: helpers.run(cmd, **kwargs), ())


def ahead_torchrun(nproc, script, *args, **kwargs):
    """ahead() of helpers.torchrun(nproc, script, *args, **kwargs)."""
    return Launch(lambda tmp: helpers.torchrun(nproc, script, *args, **kwargs), ())


def launches_in(module):
    """{global name: [its launches]} of a test module: a launch, or a dict, list or tuple of
    them."""
    found = {}
    for name, value in vars(module).items():
        values = value.values() if isinstance(value, dict) else value \
            if isinstance(value, (list, tuple)) else [value]
        held = [v for v in values if isinstance(v, Launch)]
        if held:
            found[name] = held
    return found


def _root():
    if not _ROOT:
        _ROOT.append(tempfile.mkdtemp(prefix="minddp-ahead-"))
    return _ROOT[0]


def start(launches, threads=2):
    """Run `launches`, in this order, in `threads` threads, each taking the next launch not
    begun; return them. Each sees this process's environment of now."""
    environ, stop = dict(os.environ), threading.Event()

    def ahead_of_tests():
        helpers.AHEAD.environ, helpers.AHEAD.stop = environ, stop
        for launch in launches:
            if stop.is_set():
                break
            if launch._claim():
                launch._run()
    started = [threading.Thread(target=ahead_of_tests, name=f"launches ahead {i}", daemon=True)
               for i in range(threads)]
    for thread in started:
        thread.stop = stop
        thread.start()
    return started


def stop(threads):
    """A launch a thread is running is killed (helpers.run stops it), those not begun never
    start."""
    for thread in threads:
        thread.stop.set()
    for thread in threads:
        thread.join()


def remove_folders():
    """At the session's end, after stop(): the launches' folders."""
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)
