"""Checkpoints any world size loads: PyTorch's distributed checkpoint, complete or absent.

    torchrun --nnodes=1:2 --nproc_per_node=2 ... examples/elastic.py --checkpoint-dir runs/elastic

A directory of checkpoints, one per save, and a pointer to the newest:

    DIR/step-000012/    one distributed checkpoint (torch.distributed.checkpoint, "DCP"):
                        .metadata, __0_0.distcp .. one data file per rank, and minddp.pt
                        (rank 0's small state: the step, the run's settings, the table's rows)
    DIR/latest          "step-000012": the newest complete checkpoint

DCP stores each tensor with its whole shape and, for a sharded one (an FSDP DTensor, a
ZeRO-1 rank's optimizer state), where each saved block sits; loading at another world
size reads each rank's new rows from whichever files hold them (elastic.reshard_plan).
The model and optimizer go through stock's get_state_dict/set_state_dict, so the same
code saves DDP (replicated: written once), ZeRO-1 and FSDP, minddp's or stock's, and a
checkpoint opens with stock tools (`dcp.load`,
`python -m torch.distributed.checkpoint.format_utils`).

Complete or absent: every rank writes into DIR/.step-000012.partial/; once all have
written (dcp.save returns), rank 0 renames it to step-000012 and then replaces `latest`,
both atomic. A kill at any moment leaves `latest` naming the previous checkpoint, whole.
DIR must be one directory every node sees (a shared file system) when nodes are many.
"""

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..launch.usage_error import UsageError
from ..zero.optimizer import ShardedOptimizer

FORMAT = "minddp-sharded-checkpoint/1"
# Flattened optimizer keys ("state.layers.0.weight.exp_avg"): every entry named by its
# parameter, so ZeRO-1's ranks, each holding other parameters' state, write disjoint keys.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model, optimizer):
    """{"model": ..., "optim": ...}: what DCP saves, and the tensors it loads into."""
    model = getattr(model, "module", model)  # DDP's wrapper (stock's or minddp's): the module
    if isinstance(optimizer, (ShardedOptimizer, ZeroRedundancyOptimizer)):
        optimizer = optimizer.optim  # ZeRO-1: this rank's shard of the state, its own keys
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS)}, model, optimizer


def _is_rank0(group):
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def save_sharded(directory, step, model, optimizer, extra=None, group=None):
    """Collective: write DIR/step-<step>/ and point DIR/latest at it. Returns its path.

    `extra`: small state rank 0 keeps (settings, a gradient table's state_dict()): plain
    Python values and tensors, which torch.load(weights_only=True) reads back.
    """
    name = f"step-{step:06d}"
    partial, final = os.path.join(directory, f".{name}.partial"), os.path.join(directory, name)
    if _is_rank0(group):
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save killed before: start it clean
    _barrier(group)
    state, _, _ = _state(model, optimizer)
    dcp.save(state, checkpoint_id=partial, process_group=group)  # returns when all have written
    if _is_rank0(group):
        torch.save({"format": FORMAT, "step": step, **(extra or {})},
                   os.path.join(partial, "minddp.pt"))
        shutil.rmtree(final, ignore_errors=True)  # (a run that saved this step before)
        os.rename(partial, final)                 # atomic: the checkpoint is whole, or absent
        with open(os.path.join(directory, "latest.partial"), "w") as f:
            f.write(name + "\n")
        os.replace(os.path.join(directory, "latest.partial"), os.path.join(directory, "latest"))
        _prune(directory, keep=name)
    _barrier(group)  # no rank runs ahead to a load before `latest` is written
    return final


def _prune(directory, keep, previous=1):
    """Remove checkpoints older than `keep` and the `previous` one before it."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("step-") and n <= keep)
    for old in names[:-(previous + 1)]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def latest(directory):
    """The newest complete checkpoint in DIR (a path), or None."""
    pointer = os.path.join(directory or "", "latest")
    if not directory or not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(directory, f.read().strip())


def load_sharded(directory, model, optimizer, group=None):
    """Collective: load DIR's newest checkpoint into model and optimizer, at this world size.

    Returns rank 0's saved small state (every rank gets it: "step", and the `extra` saved),
    or None when DIR holds no checkpoint. A checkpoint of another model: one line, no load.
    """
    path = latest(directory)
    if path is None:
        return None
    state, model, optimizer = _state(model, optimizer)
    check_fits(path, state["model"])
    dcp.load(state, checkpoint_id=path, process_group=group)  # each rank reads its rows
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=OPTIONS)
    return torch.load(os.path.join(path, "minddp.pt"), weights_only=True)


def check_fits(path, model_state):
    """One line when the checkpoint at `path` holds another model than `model_state`'s."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in saved.items()
             if k.startswith("model.") and hasattr(v, "size")}
    here = {k: tuple(v.shape) for k, v in model_state.items() if torch.is_tensor(v)}
    hint = "resume with the model that wrote it, or point --checkpoint at another directory"
    for key in sorted(set(saved) | set(here)):
        if saved.get(key) != here.get(key):
            said = (f"has no {key!r}" if key not in saved else
                    f"has {key!r} which this model lacks" if key not in here else
                    f"saved {key!r} with shape {list(saved[key])}, this model's is"
                    f" {list(here[key])}")
            raise UsageError(f"the checkpoint {path} does not fit this model: it {said}",
                             hint=hint, same_on_every_rank=True)
