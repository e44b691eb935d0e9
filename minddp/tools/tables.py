"""The gradient table files: written by GradTable on rank 0, read by `minddp diff`, no torch needed.

    minddp diff runs/manual.txt runs/stock.txt

    PATH      a table for people (tabulate): step, epoch, rank, parameter, norm, digest
    PATH.npz  every element, exactly: one numpy array [step, rank, *shape] per parameter,
              and the run's facts (world size, steps, names, torch version, command)
Written whole or not at all: PATH.npz.partial, then renamed.
"""

import hashlib
import json
import os
import sys
import zipfile

import numpy as np
from tabulate import tabulate

FORMAT = "minddp-gradtable/1"


class TableError(ValueError):
    """A gradient table that cannot be read."""


def _digest(a):
    return hashlib.sha1(a.tobytes()).hexdigest()[:12]  # equal digests <=> equal bits, at a glance


def write_table(path, rows_by_rank, world_sizes=None):
    """rows_by_rank[r] is rank r's list of (step, epoch, {name: array}).

    world_sizes: the run's world size at each step, when rank 0's rows alone are written
    (an elastic run's); the diff then tells a change of world size from a bug.
    """
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
        "torch": getattr(sys.modules.get("torch"), "__version__", "not loaded"),
        "script": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "world_sizes": world_sizes,
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
        sizes = (f"rank 0's rows, world size per step {' '.join(map(str, world_sizes))}"
                 if world_sizes else f"world size {meta['world_size']}")
        f.write(f"# {sizes}, {steps} steps, {len(names)} parameters, torch {meta['torch']}\n")
        f.write(f"# every element is in {os.path.basename(path)}.npz; "
                f"compare runs with: minddp diff A B\n\n")
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
