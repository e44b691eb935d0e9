"""Two gradient tables from different meshes: whole gradients compared, the first difference named.

    minddp diff runs/dp2tp2.txt runs/one.txt              # other world sizes: compared whole
    minddp diff runs/a.txt runs/b.txt --whole             # the same, at one world size

A table holds, per step, every rank's row of each parameter's whole gradient (gathered over
dp and tp; NaN on a pipeline stage that does not hold it). Two meshes give two sets of ranks,
so rows cannot be paired rank by rank. Here each table becomes one whole gradient per step
and parameter: the rows of the ranks that hold it, which must agree bit for bit (a rank
whose gradient is not its peers' is a bug of its own, named as such). Then the two are
compared element by element, and the report names where they first part: the step, the
parameter, the element, both values and how many units in the last place lie between them.
In invariant mode (minddp/invariant/) the meshes must agree to the bit: any difference is a
bug, and the first one says where it is.
"""

import numpy as np

from .tables import TableError


def whole_gradients(meta, grads, label):
    """{name: array[step, *shape]}: the ranks that hold a gradient agree; NaN where none does."""
    whole = {}
    for name, array in grads.items():
        rows = []
        for step in range(array.shape[0]):
            held = [r for r in range(array.shape[1]) if not np.isnan(array[step, r]).all()]
            for r in held[1:]:
                if array[step, r].tobytes() != array[step, held[0]].tobytes():
                    raise TableError(f"table {label}: at step {step}, rank {r}'s {name!r} is not"
                                     f" rank {held[0]}'s: its ranks disagree on one gradient")
            rows.append(array[step, held[0]] if held else np.full(array.shape[2:], np.nan,
                                                                   array.dtype))
        whole[name] = np.stack(rows) if rows else array[:, 0]
    return whole


def check_comparable(meta_a, meta_b):
    """TableError unless the two runs recorded the same parameters, steps, shapes, dtypes."""
    if meta_a["names"] != meta_b["names"]:
        only = [sorted(set(x) - set(y))[:3] for x, y in ((meta_a["names"], meta_b["names"]),
                                                         (meta_b["names"], meta_a["names"]))]
        raise TableError(f"runs are not comparable: other parameters (only in A: {only[0]},"
                         f" only in B: {only[1]})")
    for key in ("steps", "shapes", "dtypes"):
        if meta_a[key] != meta_b[key]:
            raise TableError(f"runs are not comparable: {key} differs"
                             f" ({meta_a[key]} vs {meta_b[key]})")


def compare_whole(meta_a, grads_a, meta_b, grads_b, ulp_distance):
    """(rows, first): a row per parameter; first is None (IDENTICAL) or (step, name, index,
    a, b, ulps) of the first element, step by step and in the table's parameter order, whose
    bits differ."""
    check_comparable(meta_a, meta_b)
    a_whole = whole_gradients(meta_a, grads_a, "A")
    b_whole = whole_gradients(meta_b, grads_b, "B")
    rows, first = [], None
    for name in meta_a["names"]:
        a, b = a_whole[name], b_whole[name]
        uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        differ = a.view(uint) != b.view(uint)
        ulps = np.where(np.isnan(a) & np.isnan(b), 0.0, ulp_distance(a, b))
        where = np.argwhere(differ)
        if len(where):
            step, *index = where[0]
            found = (int(step), name, tuple(int(i) for i in index), float(a[tuple(where[0])]),
                     float(b[tuple(where[0])]), int(ulps[tuple(where[0])]))
            if first is None or found[0] < first[0]:
                first = found
        gap = np.nan_to_num(np.abs(a.astype(np.float64) - b.astype(np.float64)), nan=np.inf)
        rows.append([name, "x".join(map(str, a.shape[1:])) or "scalar",
                     f"{np.max(np.where(differ, gap, 0.0), initial=0.0):.3e}",
                     f"{np.max(np.where(differ, ulps, 0.0), initial=0.0):.0f}",
                     int(np.count_nonzero(differ)), "no" if len(where) else "yes",
                     f"step {where[0][0]}" if len(where) else ""])
    return rows, first
