"""Gradient tables: every synchronized gradient, at every step, on every rank, on disk.

    torchrun --nproc_per_node=2 examples/manual_ddp.py --grad-table manual.txt
    torchrun --nproc_per_node=2 examples/stock_ddp.py  --grad-table stock.txt
    python -m minddp.diff manual.txt stock.txt

Call `record()` right after `loss.backward()`: that is when DDP's promise is due (every
.grad is the average over ranks), so on every rank the rows of one step must be equal,
and two DDP implementations must agree row by row. `save()` gathers all ranks' rows to
rank 0, which writes two files:

    PATH      a table for people (tabulate): step, epoch, rank, parameter, norm, digest
    PATH.npz  every element, exactly (numpy arrays [step, rank, *shape] per parameter),
              which is what `python -m minddp.diff` compares
"""

import hashlib
import json
import os
import sys
import zipfile

import numpy as np
import torch
import torch.distributed as dist
from tabulate import tabulate

from .errors import UsageError

FORMAT = "minddp-gradtable/1"


class TableError(ValueError):
    """A gradient table that cannot be read."""


def _to_numpy(t):
    t = t.detach().cpu()
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly.
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def _digest(a):
    return hashlib.sha1(a.tobytes()).hexdigest()[:12]  # equal digests <=> equal bits, at a glance


class GradTable:
    """Records `model`'s gradients; a no-op when `path` is None, so a loop can always call it.

    `model` may be the wrapper (stock DDP or ManualDDP): names are taken from its
    `.module`, so both wrappers give the same names ("layers.0.weight").
    """

    def __init__(self, model, path=None):
        self.module = getattr(model, "module", model)
        self.path = path
        self.rows = []  # (step, epoch, {name: gradient})

    def record(self, epoch=-1):
        if self.path is None:
            return
        grads = {}
        whole = _whole_gradients(self.module)
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue  # frozen: no gradient to compare
            # A trainable parameter with no gradient this step is recorded as NaN, so the
            # table keeps one row per parameter and step and the gap shows up in a diff.
            g = whole[name]
            if g is None:
                g = torch.full(getattr(p, "_fsdp_full_shape", p.shape), float("nan"))
            grads[name] = _to_numpy(g)
        self.rows.append((len(self.rows), epoch, grads))

    def gather(self):
        """Collective: every rank's rows, on rank 0 (None elsewhere)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [self.rows]
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self.rows, gathered, dst=0)
        return gathered

    def save(self):
        """Collective: every rank calls it; rank 0 writes PATH and PATH.npz."""
        if self.path is None:
            return
        rows_by_rank = self.gather()
        if rows_by_rank is not None:
            write_table(self.path, rows_by_rank)
            print(f"gradient table: {self.path} (every element: {self.path}.npz)", flush=True)

    def state_dict(self):
        """Collective: call on every rank. Every rank's rows so far, on rank 0 (for checkpoints).

        Rows are stored as tensors, which torch.load(weights_only=True) accepts.
        """
        rows_by_rank = self.gather() if self.path else None
        if rows_by_rank is None:
            return {"world_size": _world_size(), "rows_by_rank": None}
        return {"world_size": len(rows_by_rank),
                "rows_by_rank": [[(s, e, {n: torch.from_numpy(a) for n, a in g.items()})
                                  for s, e, g in rows] for rows in rows_by_rank]}

    def load_state_dict(self, state):
        """This rank's rows from a state_dict(); the world size must be the same."""
        if not self.path:
            return
        if state["rows_by_rank"] is None or state["world_size"] != _world_size():
            raise UsageError(
                f"cannot continue the gradient table: the checkpoint was saved at world size"
                f" {state['world_size']} {'without' if state['rows_by_rank'] is None else 'with'}"
                f" a table, this run has world size {_world_size()}",
                hint="resume with the same --nproc_per_node and --grad-table, or start afresh",
                same_on_every_rank=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.rows = [(s, e, {n: t.cpu().numpy() for n, t in g.items()})
                     for s, e, g in state["rows_by_rank"][rank]]


def _whole_gradients(module):
    """{name: gradient}; a sharded model's (FSDP) gathered whole first: a collective then."""
    if any(hasattr(m, "_fsdp_unit") for m in module.modules()):  # minddp's fully_shard
        from .fsdp_state import full_gradients
        return full_gradients(module)
    # Stock fully_shard's gradients are DTensors; full_tensor() gathers one.
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in module.named_parameters()}


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def write_table(path, rows_by_rank):
    """rows_by_rank[r] is rank r's list of (step, epoch, {name: array})."""
    steps = len(rows_by_rank[0])
    if any(len(rows) != steps for rows in rows_by_rank):
        raise TableError("ranks recorded different numbers of steps: " +
                         ", ".join(str(len(rows)) for rows in rows_by_rank))
    names = list(rows_by_rank[0][0][2]) if steps else []
    arrays = {name: np.stack([np.stack([rows[s][2][name] for rows in rows_by_rank])
                              for s in range(steps)])
              for name in names}
    meta = {
        "format": FORMAT,
        "world_size": len(rows_by_rank),
        "steps": steps,
        "epochs": [rows_by_rank[0][s][1] for s in range(steps)],
        "names": names,
        "shapes": [list(arrays[n].shape[2:]) for n in names],
        "dtypes": [str(arrays[n].dtype) for n in names],
        "torch": torch.__version__,
        "script": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    with open(path + ".npz.partial", "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), **{"grad/" + n: a for n, a in arrays.items()})
    os.replace(path + ".npz.partial", path + ".npz")  # a crash mid-write leaves no half table

    table = []
    for s in range(steps):
        for r in range(len(rows_by_rank)):
            for n in names:
                g = arrays[n][s, r]
                table.append([s, meta["epochs"][s], r, n, "x".join(map(str, g.shape)) or "scalar",
                              f"{np.linalg.norm(g.astype(np.float64)):.6e}",
                              f"{g.astype(np.float64).mean():+.6e}" if g.size else "", _digest(g)])
    with open(path, "w") as f:
        f.write(f"# minddp gradient table: {meta['script']}\n")
        f.write(f"# world size {meta['world_size']}, {steps} steps, {len(names)} parameters, "
                f"torch {meta['torch']}\n")
        f.write(f"# every element is in {os.path.basename(path)}.npz; "
                f"compare runs with: python -m minddp.diff A B\n\n")
        f.write(tabulate(table, headers=["step", "epoch", "rank", "parameter", "shape",
                                         "norm", "mean", "sha1"], disable_numparse=True))
        f.write("\n")


def read_table(path):
    """(meta, {name: array[step, rank, *shape]}) from PATH or PATH.npz; TableError if unreadable."""
    npz = path if path.endswith(".npz") else path + ".npz"
    if not os.path.exists(npz):
        what = "no such file" if not os.path.exists(path) else f"its element file {npz} is missing"
        raise TableError(f"cannot read {path}: {what}")
    if not zipfile.is_zipfile(npz):  # np.load would speak of pickles, which do not apply
        raise TableError(f"cannot read {path}: {npz} is damaged or not a minddp gradient table"
                         f" (not a .npz archive)")
    try:
        with np.load(npz, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != FORMAT:
                raise TableError(f"cannot read {path}: format {meta.get('format')!r},"
                                 f" expected {FORMAT!r}")
            grads = {n: data["grad/" + n] for n in meta["names"]}
    except TableError:
        raise
    except Exception as err:  # zip, npy or json damage: all mean "not a table we wrote"
        raise TableError(f"cannot read {path}: not a minddp gradient table"
                         f" ({type(err).__name__}: {err})")
    return meta, grads
