"""Fault injection: one rank dies on purpose, so a restart can be watched and tested.

    torchrun --nproc_per_node=2 --max-restarts=1 examples/restart.py \\
        --checkpoint runs/ck.pt --crash-at-step 3

Used by examples/restart.py and the tests; the lesson's examples never call it.
"""

import os
import time

import torch.distributed as dist

from ..launch.usage_error import UsageError
from ..launch.start import get_rank, print_rank
from .errors import EXIT_INJECTED_CRASH


def check_crash_step(crash_at_step, total_steps):
    """Refuse, before training, a --crash-at-step that the run would never reach."""
    if crash_at_step is not None and not 1 <= crash_at_step <= total_steps:
        raise UsageError(f"--crash-at-step {crash_at_step} is never reached: this run takes"
                         f" {total_steps} optimizer steps",
                         hint=f"choose a step from 1 to {total_steps}",
                         same_on_every_rank=True)


def crash_if_asked(step, crash_at_step, crash_rank=None):
    """Die abruptly as optimizer step `crash_at_step` (counted from 1) begins.

    `crash_rank` defaults to the last rank, so rank 0 survives to report. Only on the
    first attempt: torchrun sets TORCHELASTIC_RESTART_COUNT, and a restarted worker
    must not crash again.
    """
    if crash_at_step is None or step != crash_at_step:
        return
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if get_rank() != (world_size - 1 if crash_rank is None else crash_rank):
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    print_rank(f"--crash-at-step {step}: exiting abruptly")
    # os._exit: no cleanup, no exception handlers, no atexit, like a killed process.
    os._exit(EXIT_INJECTED_CRASH)


def hold_before(step, hold_file):
    """Wait before `step` while HOLD_FILE holds a number smaller than it (no file: no wait).

    A gate a test or a demo moves step by step: write 1 and the job stops after step 1;
    stop a node there, write 2, start one... Each event then lands at a known step, however
    fast the machine. Called between steps, outside any collective.
    """
    while hold_file and os.path.exists(hold_file):
        with open(hold_file) as f:
            text = f.read().strip()
        if text and int(text) >= step:
            return
        time.sleep(0.05)
