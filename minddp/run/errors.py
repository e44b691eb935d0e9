"""Errors a student will hit: one clear line, a hint, a non-zero exit.

A wrong setup in distributed training usually shows up as a 40-line traceback from
deep inside torch.distributed, or worse, as a rank waiting forever for a peer that
already died. minddp checks the common mistakes *before* the first collective and
raises `UsageError`; the examples wrap `main()` in `exit_on_usage_error()`, which
prints two lines and exits with status 2:

    error: nccl needs CUDA, but torch.cuda.is_available() is False here
    ---> HINT: leave --backend at auto (gloo on CPU), or install a CUDA build of PyTorch

(Under torchrun the agent then adds its own failure report; read the first lines.)

`exit_on_failure()` turns a *collective that failed* (a peer died, or stopped
taking part until the process-group timeout ran out, see launch/start.py) into one line with
the rank that saw it, and exit status 1, instead of the backend's C++ traceback.
"""

import contextlib
import gc
import os
import signal
import sys
import threading
import time
import traceback

# The lessons' one error type; this file turns it into an exit.
from ..launch.usage_error import UsageError

# Every exit status minddp's scripts give, in one place:
EXIT_FAILURE = 1  # a collective that failed, or any other error while a group lives
EXIT_USAGE = 2  # a UsageError: the command line, the data or the machine (argparse's, too)
EXIT_INJECTED_CRASH = 17  # faults.py's crash on purpose, so a test tells it from a bug
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
RANK_0_FIRST_S = 2  # how long a silent rank waits before it exits (rank_0_speaks_first)

# How gloo and nccl word "your peer is gone": a dead peer closes its sockets at once; a
# live one that never joins the collective is noticed when the timeout runs out.
_COLLECTIVE_FAILURES = ("Timed out", "timed out", "Connection closed by peer",
                        "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
                        "Watchdog caught collective operation timeout")


def is_collective_failure(err):
    """Did a collective fail because a peer timed out or is gone (not a bug of this rank)?"""
    return any(marker in str(err) for marker in _COLLECTIVE_FAILURES)


class CollectiveFailure(RuntimeError):
    """A collective that did not complete, with what this rank knows of why: exit 1 at once."""

    def __init__(self, message, hint):
        super().__init__(message)
        self.hint = hint


@contextlib.contextmanager
def exit_on_usage_error():
    """A UsageError: prints `error:` and `---> HINT:` lines (once, not per rank), exits 2."""
    try:
        yield
    except UsageError as err:
        _exit_usage(err)


@contextlib.contextmanager
def exit_on_failure():
    """Any other failure while a process group is alive: report it and exit 1 at once.

    A failed collective (a peer died or timed out): one line naming it. Ctrl-C: one line,
    `interrupted`, exit 130 as shells expect. Anything else: its traceback. Then os._exit,
    no interpreter teardown: the traceback's frames hold the model, and the interpreter's
    exit would free it with the group's threads still running (teardown.ddp_teardown).
    """
    # Ctrl-C: leave from the signal handler itself. A KeyboardInterrupt raised wherever the
    # main thread happens to be can land in a __del__ or a callback, where Python prints
    # "Exception ignored" and goes on training.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupted) if main else None
    try:
        yield
    except UsageError:
        raise  # exit_on_usage_error's
    except CollectiveFailure as err:
        _exit_collective(str(err), err.hint)
    except Exception as err:
        if not _group_alive():
            raise
        text = str(err)
        if any(marker in text for marker in _COLLECTIVE_FAILURES):
            _exit_collective(text)
        traceback.print_exc()
        _hard_exit(EXIT_FAILURE)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def interrupted(signum, frame):
    """SIGINT's handler: one line, `[rankN] interrupted`, and exit 130 at once."""
    print(f"[rank{os.environ.get('RANK', '0')}] interrupted", file=sys.stderr, flush=True)
    _hard_exit(EXIT_INTERRUPTED)


def _exit_usage(err):
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or not err.same_on_every_rank:
        prefix = f"[rank{rank}] " if "RANK" in os.environ and not err.same_on_every_rank else ""
        print(f"{prefix}error: {err.message}", file=sys.stderr, flush=True)
        if err.hint:
            print(f"{prefix}---> HINT: {err.hint}", file=sys.stderr, flush=True)
    else:
        rank_0_speaks_first()
    # minddp's checks depend only on the command line, the data and the machine,
    # so every rank raises at the same point and none is left waiting in a
    # collective. Leave the group as a clean run would: the traceback's frames hold
    # the model, so free them first (the order teardown.ddp_teardown explains).
    traceback.clear_frames(err.__traceback__)
    if _group_alive():
        gc.collect()
        sys.modules["torch.distributed"].destroy_process_group()
    sys.exit(EXIT_USAGE)


def rank_0_speaks_first():
    """On a rank that stays silent about a mistake rank 0 reports: a moment before exiting.

    torchrun stops every worker as soon as one has failed; a silent rank that exits first
    could have rank 0 stopped before it has printed why, on a busy machine."""
    time.sleep(RANK_0_FIRST_S)


def _exit_collective(text, hint=None):
    rank = int(os.environ.get("RANK", "0"))
    first = next(line for line in text.splitlines() if line.strip())
    first = first.split("] ", 1)[-1] if first.startswith("[") else first  # drop the C++ file:line
    first = first.split(". ", 1)[0]  # the fact, without gloo's boilerplate advice
    print(f"[rank{rank}] error: a collective did not complete: {first.strip()}",
          file=sys.stderr, flush=True)
    hint = hint or ("another rank died or stopped taking part (its own lines above say why);"
                    " a rank gives up after the process-group timeout (--timeout S,"
                    " ddp_setup(timeout=S))")
    print(f"[rank{rank}] ---> HINT: {hint}", file=sys.stderr, flush=True)
    # The group is broken: no destroy_process_group() (it may wait for the peer that is
    # gone), and no interpreter teardown either, whose C++ destructors would meet the
    # group's still-running threads and abort ("terminate called ...", SIGABRT).
    _hard_exit(EXIT_FAILURE)


def _group_alive():
    # Without importing torch: a command-line mistake is refused before torch ever loads.
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _hard_exit(status):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
