"""async_op=True: the collective runs on a thread of its own while the caller goes on.

    pytest tests/test_collectives.py -k async     # async results equal the blocking ones

Stock's collectives run in the backend's C++ threads; this chapter's, written in Python, run
on one thread per process, one after another, in the order they were called. The order
matters more than the thread: ranks pair their messages up by the order of their calls, so
if a later collective overtook an earlier one on one rank, two ranks would be exchanging
blocks of different collectives. A blocking call (async_op=False) joins the same queue and
waits for its turn, so it cannot overtake an async one either.
What the caller gets back is stock's: None, or a Work whose wait() returns once the
collective is done (True, or the collective's exception raised again here).
Stock's collectives write in C++, where autograd never looks: a Parameter is averaged in
place under no_grad or not, and a tensor made in inference_mode in it or outside it. A thread
of our own has neither the caller's grad mode nor its inference mode, and autograd would
refuse those in-place writes (tests); so the collectives run in inference_mode, where it
records nothing and refuses none of them, whoever called.
"""

import queue
import threading

import torch

_QUEUE = queue.SimpleQueue()  # (work, collective, args), in call order
_STARTED = []  # the thread, once started
_LOCK = threading.Lock()  # autograd's thread and the main thread may both start it


class Work:
    """What a collective called with async_op=True returns (stock's name): wait() ends it."""

    def __init__(self, result):
        """`result`: the tensors the collective writes (what get_future() gives back)."""
        self.result = result
        self.error = None
        self._done = threading.Event()
        self._future = torch.futures.Future()

    def wait(self, timeout=None):
        """Block until the collective is done; raise what it raised. True, as stock's."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        """Has the collective finished (or failed)?"""
        return self._done.is_set()

    def get_future(self):
        """A torch.futures.Future of the written tensors, done when the collective is."""
        return self._future

    def _finish(self, error=None):
        self.error = error
        self._done.set()
        if error is None:
            self._future.set_result(self.result)
        else:  # the error's words only: the future is C++, out of the garbage collector's
            # reach, and the error's traceback holds the frames that hold the group
            self._future.set_exception(RuntimeError(str(error)))


def launch(collective, args, result, async_op):
    """Queue collective(*args) for the collectives' thread: its Work, or wait and None."""
    with _LOCK:
        if not _STARTED:
            # A daemon: a collective stuck in a hang never keeps the process from exiting.
            thread = threading.Thread(target=_run_in_order, name="minddp-collectives",
                                      daemon=True)
            thread.start()
            _STARTED.append(thread)
    work = Work(result)
    _QUEUE.put((work, collective, args))
    if async_op:
        return work
    work.wait()
    return None


def _run_in_order():
    while True:
        work, collective, args = _QUEUE.get()
        try:
            with torch.inference_mode():  # out of autograd's sight, as stock's C++
                collective(*args)
        except Exception as error:  # handed to whoever waits: a mistake is the caller's
            work._finish(error)
        else:
            work._finish()
        # Hold nothing while idle: a group kept alive here by the last call's arguments
        # would keep its gloo threads running past destroy_process_group (teardown.py).
        del work, collective, args
