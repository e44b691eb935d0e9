"""Checkpoints, and a crash on purpose: what lets torchrun restart a job that lost a rank.

    torchrun --nproc_per_node=2 --max-restarts=1 examples/manual_ddp.py \
        --checkpoint ck.pt --crash-at-step 3 --grad-table t.txt

When one worker dies, torchrun's agent stops the others and, if --max-restarts allows,
starts every worker again from the top of the script. Nothing survives in memory, so the
script itself must find where it was: it saves a checkpoint after every epoch and, at
start, resumes from one if the file exists. Done right, the restarted job ends with
bitwise the same weights and gradients as a job that never crashed (tests/test_faults.py).

Exact resumption needs everything the remaining steps read: the weights, the optimizer
state (SGD's momentum buffers, Adam's moments), where to go on (the next epoch, the
global step), and here the gradient table's rows so far. The data order needs nothing:
the sampler shuffles with seed + epoch, so epoch 3 is epoch 3 whether or not we crashed.
"""

import os

import torch
import torch.distributed as dist

from .errors import UsageError
from .gradtable import GradTable
from .launch import get_rank

FORMAT = "minddp-checkpoint/1"


def save_checkpoint(path, model, optimizer, epoch, step, grad_table):
    """Collective (the table rows are gathered): rank 0 writes PATH, atomically."""
    if path is None:
        return
    rows_by_rank = grad_table.gather() if grad_table.path else None
    if get_rank() != 0:
        # Global rank 0 only: one writer per job. Local rank 0 would be one per node,
        # and on a shared file system they would overwrite each other's file.
        return
    state = {
        "format": FORMAT,
        "model": getattr(model, "module", model).state_dict(),  # unwrapped: loads without DDP
        "optimizer": optimizer.state_dict(),
        "epoch": epoch + 1,  # the epoch to start from on resume
        "step": step,  # optimizer steps taken so far, over all epochs
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "grad_table": None if rows_by_rank is None else
        [GradTable.rows_to_tensors(rows) for rows in rows_by_rank],
    }
    # Write aside, then rename: os.replace is atomic, so a crash in the middle of the
    # write leaves the previous checkpoint whole, never half of a new one.
    partial = f"{path}.partial"
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(path, model, optimizer, grad_table, device):
    """Resume from PATH if it exists; return (first epoch, steps taken), (0, 0) without one.

    Call it on the unwrapped model, on every rank: each rank reads the file itself and
    maps the tensors to its own device (a checkpoint saved from cuda:0 must not land
    every rank's copy on GPU 0).
    """
    if path is None or not os.path.exists(path):
        return 0, 0
    hint = "delete or move it to start afresh"
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # truncated, not a torch file, unpickling refused
        first = (str(err).strip().splitlines() or [""])[0][:100]
        raise UsageError(f"cannot resume from {path}: not a minddp checkpoint"
                         f" ({type(err).__name__}: {first})", hint=hint, same_on_every_rank=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"cannot resume from {path}: not a minddp checkpoint (no {FORMAT!r} in it)",
                         hint=hint, same_on_every_rank=True)
    model.load_state_dict(state["model"])  # every name and shape must match, or it says which
    optimizer.load_state_dict(state["optimizer"])
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if grad_table.path:
        if state["grad_table"] is None or state["world_size"] != world_size:
            raise UsageError(
                f"cannot continue the gradient table from {path}: it was saved at world size"
                f" {state['world_size']} {'without' if state['grad_table'] is None else 'with'}"
                f" a table, this run has world size {world_size}",
                hint="resume with the same --nproc_per_node and --grad-table, or start afresh",
                same_on_every_rank=True)
        grad_table.load_rows(state["grad_table"][get_rank()])
    return state["epoch"], state["step"]


def check_crash_step(crash_at_step, total_steps):
    """Refuse, before training, a --crash-at-step that the run would never reach."""
    if crash_at_step is not None and not 1 <= crash_at_step <= total_steps:
        raise UsageError(f"--crash-at-step {crash_at_step} is never reached: this run takes"
                         f" {total_steps} optimizer steps", hint=f"choose a step from 1 to {total_steps}",
                         same_on_every_rank=True)


def crash_if_asked(step, crash_at_step, crash_rank=None):
    """The lesson's fault injection: die abruptly as optimizer step `crash_at_step` begins.

    `step` counts from 1; `crash_rank` defaults to the last rank, so rank 0 survives to
    report. Only on the first attempt: torchrun sets TORCHELASTIC_RESTART_COUNT, and a
    restarted worker must not crash again.
    """
    if crash_at_step is None or step != crash_at_step:
        return
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if get_rank() != (world_size - 1 if crash_rank is None else crash_rank):
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    print(f"[rank{get_rank()}] --crash-at-step {step}: exiting abruptly", flush=True)
    # os._exit: no cleanup, no exception handlers, no atexit, like a killed process.
    os._exit(17)
