"""Checkpoints: what lets torchrun restart a job that lost a rank, and resume bit for bit.

    torchrun --nproc_per_node=2 --max-restarts=1 examples/restart.py \\
        --checkpoint runs/ck.pt --crash-at-step 3 --grad-table runs/t.txt

When one worker dies, torchrun's agent stops the others and, if --max-restarts allows,
starts every worker again from the top of the script. Nothing survives in memory, so the
script itself must find where it was: it saves a checkpoint after every epoch and, at
start, resumes from one if the file exists. Done right, the restarted job ends with
bitwise the same weights and gradients as a job that never crashed (tests/test_faults.py).

Exact resumption needs everything the remaining steps read: the weights, the optimizer
state (SGD's momentum buffers, Adam's moments), where to go on (the next epoch, the
global step), and here the gradient table's rows so far. The data order needs nothing:
the sampler shuffles with seed + epoch, so epoch 3 is epoch 3 whether or not we crashed.
Anything with PyTorch's `state_dict()` / `load_state_dict()` can be saved alongside.
"""

import os

import torch

from ..launch.usage_error import UsageError
from ..launch.start import get_rank, print0

FORMAT = "minddp-checkpoint/2"


def save_checkpoint(path, epoch, step, **stateful):
    """Save a checkpoint: rank 0 writes PATH atomically.

    Collective: call on every rank.
    `stateful`: name=object pairs, each saved through its state_dict() (the model, the
    optimizer, a GradTable, whose state_dict() is itself a collective).
    """
    if path is None:
        return
    states = {name: obj.state_dict() for name, obj in stateful.items()}
    if get_rank() != 0:
        # Global rank 0 only: one writer per job. Local rank 0 would be one per node,
        # and on a shared file system they would overwrite each other's file.
        return
    state = {"format": FORMAT, "epoch": epoch + 1, "step": step, "state": states}
    # Write aside, then rename: os.replace is atomic, so a crash in the middle of the
    # write leaves the previous checkpoint whole, never half of a new one.
    partial = f"{path}.partial"
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(path, device, epochs=None, **stateful):
    """Resume from PATH if it exists; return (first epoch, steps taken), (0, 0) without one.

    Call it on every rank: each rank reads the file itself and maps the tensors to its own
    device (a checkpoint saved from cuda:0 must not land every rank's copy on GPU 0). The
    model is the unwrapped module (`model.module` once wrapped): loading copies in place.
    It says what it found in one line; given the run's `epochs`, a checkpoint that already
    holds them is called finished instead of resumed.
    """
    if path is None or not os.path.exists(path):
        return 0, 0
    hint = "delete or move it to start afresh"
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # truncated, not a torch file, unpickling refused
        first = (str(err).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
        raise UsageError(f"cannot resume from {path}: it is damaged or not a minddp checkpoint"
                         f" ({type(err).__name__}: {first})", hint=hint, same_on_every_rank=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"cannot resume from {path}: not a minddp checkpoint"
                         f" (no {FORMAT!r} in it)",
                         hint=hint, same_on_every_rank=True)
    for name, obj in stateful.items():
        obj.load_state_dict(state["state"][name])  # names and shapes must match, or it says which
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if epochs is not None and state["epoch"] >= epochs:
        print0(f"{path} holds a finished run ({state['epoch']} epochs): nothing left to train;"
               f" delete it to start afresh, or ask for more --epochs")
    else:
        print0(f"resuming from {path}: epoch {state['epoch'] + 1}, after step {state['step']}"
               f" (torchrun attempt {attempt})")
    return state["epoch"], state["step"]
