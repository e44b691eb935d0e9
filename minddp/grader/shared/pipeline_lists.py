"""The pipeline's lists past 1F1B as stock writes them: made on real stages, read, spelled.

    minddp grade exercises/interleaved.py    # checks/interleaved.py and zero_bubble.py use these

Stock writes every rank's list when a schedule is made (`pipeline_order`: what its runtime
runs, action for action, tests/test_pp_interleaved.py). Each rank makes stock's schedule on
real stages of its own (stage s on rank s % W), 2 and 3 stages a rank, every microbatch count
of 1-9 that stock accepts (n a multiple of its rounds, max(1, n // W)). An action reads as
stock writes it, "sFi": stage s runs F (forward), B (backward), I (the input's gradient) or W
(the weights') of microbatch i; None is a slot the rank waits.
"""

import re

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage  # before any group


COUNTS = (1, 2, 3, 4, 5, 6, 8, 9)  # microbatches: those stock accepts at W ranks
LOCAL = (2, 3)  # stages per rank
KINDS = {"F": "forward", "B": "backward", "I": "input's gradient", "W": "weights' gradient"}


def accepted(world_size):
    """The counts stock's interleaved schedules accept: n a multiple of max(1, n // W)."""
    return [n for n in COUNTS if n % max(1, n // world_size) == 0]


def _stock(cls, rank, world_size, local, n):
    """Stock's schedule on this rank's real stages (rank, rank + W, ...): nothing runs."""
    stages = [PipelineStage(torch.nn.Linear(4, 4), s, local * world_size, torch.device("cpu"))
              for s in range(rank, local * world_size, world_size)]
    return cls(stages, n, loss_fn=F.mse_loss)


def _strings(actions):
    return [None if a is None else str(a) for a in actions]


def _parse(action):
    """"12I3" -> (12, "I", 3)."""
    stage, kind, i = re.fullmatch(r"(\d+)([FBIW])(\d+)", action).groups()
    return int(stage), kind, int(i)


def _unreadable(actions):
    """One line for an action that is not "sFi" (a tuple, a typo), or ""."""
    bad = next((a for a in actions if a is not None and not re.fullmatch(r"\d+[FBIW]\d+", a)),
               None)
    return "" if bad is None else (f"an action written {bad!r}: each is a string \"sFi\" (stage,"
                                   f" F/B/I/W, microbatch: _action(s, kind, i)) or None")


def _spell(action):
    if action is None:
        return "(none)"
    stage, kind, i = _parse(action)
    return f"{action} (stage {stage}'s {KINDS[kind]} of microbatch {i})"


def _stages(rank, world_size, local):
    return ", ".join(str(s) for s in range(rank, local * world_size, world_size))


def _microbatches(n):
    return f"{n} microbatch{'es' * (n != 1)}"
