"""Compare two gradient tables element by element.

    minddp diff runs/manual.txt runs/stock.txt                 # identical bits, or not
    minddp diff runs/manual.txt runs/stock.txt --atol 1e-6     # close enough

Exit status: 0 identical (or within --atol/--rtol when given), 1 they differ,
2 a table is unreadable or the runs are not comparable (world size, steps, parameters).

Why two runs of the same math can differ in the last bits: float addition is not
associative, (a + b) + c != a + (b + c) in general. With two ranks an all_reduce computes
a + b, the same either way round; with three or more, two all_reduce implementations may
add in another order and disagree by an ulp or so. "max ulps" below counts that distance
in units in the last place, so rounding noise (a few ulps) is easy to tell from a bug.
"""

import sys

import numpy as np
from tabulate import tabulate

from ..run.cli import ArgumentParser
from .across import check_comparable, compare_whole
from .tables import TableError, read_table


def ulp_distance(a, b):
    """How many representable floats lie between a and b (0 = same value), elementwise."""
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    magnitude = np.int64(np.iinfo(ints).max)  # every bit but the sign
    ia, ib = a.view(ints).astype(np.int64), b.view(ints).astype(np.int64)
    # Floats are sign-magnitude: their bits, read as integers, count up for positive values
    # and down for negative ones. Flip the negative half onto one monotonic line (-0.0 and
    # +0.0 both land on 0); neighbouring floats are then neighbouring integers.
    ia = np.where(ia < 0, -(ia & magnitude), ia)
    ib = np.where(ib < 0, -(ib & magnitude), ib)
    return np.abs(ia.astype(np.float64) - ib.astype(np.float64))


def compare(meta_a, grads_a, meta_b, grads_b, atol=None, rtol=None):
    """Compare two loaded tables.

    Returns (rows, verdict, onset): one summary row per parameter; verdict 0 when every
    element is bitwise equal (or, with a tolerance, within it), else 1; onset is None or
    (first step that differs, largest gap there in rounding units of that step's largest
    element), which tells rounding from a bug.
    """
    if meta_a["world_size"] != meta_b["world_size"]:
        raise TableError(f"runs are not comparable rank by rank: world size"
                         f" {meta_a['world_size']} vs {meta_b['world_size']}")
    check_comparable(meta_a, meta_b)
    tolerant = atol is not None or rtol is not None
    atol, rtol = atol or 0.0, rtol or 0.0
    rows, verdict, onset = [], 0, None
    for name in meta_a["names"]:
        a, b = grads_a[name], grads_b[name]
        # Compare bits, not values: 0.0 == -0.0 as values, and NaN != NaN.
        uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        bits_differ = a.view(uint) != b.view(uint)
        bitwise = not bits_differ.any()
        both_nan = np.isnan(a) & np.isnan(b)
        diff = np.where(both_nan, 0.0, np.abs(a.astype(np.float64) - b.astype(np.float64)))
        ulps = np.where(both_nan, 0.0, ulp_distance(a, b))
        scale = np.abs(b.astype(np.float64))
        rel = np.divide(diff, scale, out=np.where(diff > 0, np.inf, 0.0), where=scale > 0)
        if not (bitwise or (tolerant and bool(np.all(diff <= atol + rtol * scale)))):
            verdict = 1
        # [step, rank, element] of every differing element
        changed = np.argwhere(bits_differ.reshape(a.shape[0], a.shape[1], -1))
        first = ""
        if len(changed):
            step, rank = changed[0][:2]
            first = f"step {step} rank {rank}"
            # The gap at the first differing step, in rounding units of that step's largest
            # element: rounding in a sum shows up at the scale of its largest term.
            # (nanmax: a pipeline stage's table holds NaN for the other stages' weights)
            largest = np.nanmax(scale[step], initial=0.0)
            unit = np.finfo(a.dtype).eps * max(float(largest), np.finfo(a.dtype).tiny)
            gap = float(np.nanmax(diff[step], initial=0.0)) / unit
            if onset is None or step < onset[0]:
                onset = (int(step), gap)
            elif step == onset[0]:
                onset = (onset[0], max(onset[1], gap))
        rows.append([name, "x".join(map(str, a.shape[2:])) or "scalar",
                     f"{np.max(diff, initial=0.0):.3e}", f"{np.max(rel, initial=0.0):.3e}",
                     f"{np.max(ulps, initial=0.0):.0f}", int(np.count_nonzero(bits_differ)),
                     "yes" if bitwise else "no", first])
    return rows, verdict, onset


def disagreeing_ranks(grads):
    """(step, rank, parameter) where a rank's gradient first differs from rank 0's, else None.

    After a synced backward DDP gives every rank the same average: rows that differ
    between ranks mean the averaging was skipped. A rank whose row is all NaN has no such
    gradient (a pipeline stage holds only its own layers) and is not compared.
    """
    for step in range(next(iter(grads.values())).shape[0] if grads else 0):
        for name, g in grads.items():
            for rank in range(1, g.shape[1]):
                if np.isnan(g[step, rank]).all() or np.isnan(g[step, 0]).all():
                    continue  # a rank without this gradient: another pipeline stage's weight
                if g[step, rank].tobytes() != g[step, 0].tobytes():
                    return step, rank, name
    return None


def constant_factor(grads_a, grads_b, step):
    """f when A's gradients are f times B's at `step`, element by element (to 1e-5), else None."""
    ratios = []
    for name in grads_a:
        a, b = grads_a[name][step].astype(np.float64), grads_b[name][step].astype(np.float64)
        keep = np.abs(b) > 1e-30
        ratios.append(a[keep] / b[keep])
    ratios = np.concatenate([r.ravel() for r in ratios]) if ratios else np.array([])
    if ratios.size == 0:
        return None
    factor = float(np.median(ratios))
    if abs(factor - 1) < 1e-5 or not np.all(np.abs(ratios - factor) <= 1e-5 * abs(factor)):
        return None
    return factor


def partial_factor(grads_a, grads_b, step):
    """(f, names) when only some parameters differ at `step`, each f times B's (an expert's
    average skipped, say), the rest bitwise equal; else None."""
    names = [n for n in grads_a if grads_a[n][step].tobytes() != grads_b[n][step].tobytes()]
    if not names or len(names) == len(grads_a):
        return None
    factor = constant_factor({n: grads_a[n] for n in names}, {n: grads_b[n] for n in names}, step)
    return None if factor is None else (factor, names)


def world_size_change(meta_a, meta_b, step):
    """(first step, A's size, B's size) where the runs' world sizes part, at or before `step`."""
    sizes_a, sizes_b = meta_a.get("world_sizes"), meta_b.get("world_sizes")
    if not sizes_a or not sizes_b:
        return None
    for s, (a, b) in enumerate(zip(sizes_a, sizes_b)):
        if a != b and s <= step:
            return s, a, b
    return None


def main(argv=None):
    parser = ArgumentParser(prog="minddp diff", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="gradient table of run A (PATH or PATH.npz)")
    parser.add_argument("b", help="gradient table of run B")
    parser.add_argument("--atol", type=float,
                        help="pass when |a - b| <= atol + rtol*|b| everywhere")
    parser.add_argument("--rtol", type=float, help="relative tolerance (see --atol)")
    parser.add_argument("--whole", action="store_true", help="compare whole gradients, not"
                        " rank by rank (the default for tables of different world sizes)")
    args = parser.parse_args(argv)
    try:
        meta_a, grads_a = read_table(args.a)
        meta_b, grads_b = read_table(args.b)
        if args.whole or meta_a["world_size"] != meta_b["world_size"]:
            return _main_whole(args, meta_a, grads_a, meta_b, grads_b)
        rows, verdict, onset = compare(meta_a, grads_a, meta_b, grads_b, args.atol, args.rtol)
    except TableError as err:
        print(f"minddp diff: {err}", file=sys.stderr)
        print("---> HINT: record both runs with --grad-table PATH, the same model and steps"
              " (and one world size, for a diff rank by rank)", file=sys.stderr)
        return 2
    print(f"A: {args.a}   ({meta_a['script']}, torch {meta_a['torch']})")
    print(f"B: {args.b}   ({meta_b['script']}, torch {meta_b['torch']})")
    sizes = (f"world size per step {' '.join(map(str, meta_a['world_sizes']))} (A),"
             f" {' '.join(map(str, meta_b['world_sizes']))} (B), rank 0's rows"
             if meta_a.get("world_sizes") and meta_b.get("world_sizes")
             else f"world size {meta_a['world_size']}")
    print(f"{sizes}, {meta_a['steps']} steps, {len(rows)} parameters\n")
    print(tabulate(rows, headers=["parameter", "shape", "max abs diff", "max rel diff", "max ulps",
                                  "elements differing", "bitwise equal", "first difference"],
                   disable_numparse=True))
    if onset is None:
        print("\nverdict: IDENTICAL (every element of every step on every rank, bit for bit)")
        return 0
    step, gap = onset
    print(f"\nthe runs part at step {step}, by {gap:.1f} rounding units"
          f" (eps x largest |grad|)", end="")
    resized = world_size_change(meta_a, meta_b, step)
    if resized is not None and gap <= 16:
        # An elastic run went on at another world size: same samples, same math, but an
        # all_reduce over 3 ranks adds the gradients in another order than over 4.
        first, size_a, size_b = resized
        print(f": the size of a different summation order, not of a wrong gradient: from step"
              f" {first} A reduced over {size_a} ranks and B over {size_b}, and a sum over"
              f" another number of ranks adds in another order (an elastic resize; a reduction"
              f" in a fixed order, examples/elastic.py --reduce ordered, keeps the bits)")
    elif gap <= 16:
        # A wrong average is off by a factor, millions of ulps; reordered sums by one or two.
        # Later steps train on slightly different weights, so the gap then grows.
        example = ("e.g. NaiveDDP's one all_reduce per parameter adds 3+ ranks' gradients in"
                   " another order than stock's flat buckets" if meta_a["world_size"] >= 3 else
                   "with 1 or 2 ranks a reduction has one order, so the order differs in the"
                   " computation, e.g. a bias added after a sum instead of before")
        print(f": the size of a different summation order, not of a wrong gradient ({example});"
              f" later steps inherit it through the weights")
    else:
        print(": more than rounding, so the runs compute different gradients")
        factor, some = constant_factor(grads_a, grads_b, step), partial_factor(
            grads_a, grads_b, step)
        if factor is not None or some is not None:
            # The same weights (step 0, or the steps before the runs parted), gradients a
            # constant factor apart: a loss or an average scaled differently.
            factor = factor if factor is not None else some[0]
            guess = ("a sum not divided by world size?" if abs(factor - meta_a["world_size"]) < 1e-3
                     else "a mean divided twice?" if abs(factor * meta_a["world_size"] - 1) < 1e-3
                     else "a loss scaled differently?")
            which = "" if some is None else (
                f" for {len(some[1])} of {len(grads_a)} parameters ({some[1][0]}, ...; the rest"
                f" equal)")
            print(f"{factor:.3f}x: at step {step} A's gradients are {factor:.3f} times B's{which},"
                  f" element by element: {guess}")
    for label, grads in (("A", grads_a), ("B", grads_b)):
        split = disagreeing_ranks(grads)
        if split is not None:
            print(f"table {label}: at step {split[0]} rank {split[1]}'s {split[2]!r}"
                  f" differs from rank"
                  f" 0's, where a synced gradient is the same on every rank: the averaging was"
                  f" skipped (no all_reduce?)")
    if verdict == 0:
        print(f"verdict: WITHIN TOLERANCE (atol={args.atol}, rtol={args.rtol}), not bitwise equal")
    else:
        print("verdict: DIFFERENT")
    return verdict


def _main_whole(args, meta_a, grads_a, meta_b, grads_b):
    """Tables of two meshes: one whole gradient per step and parameter, compared bitwise."""
    if args.atol is not None or args.rtol is not None:
        raise TableError("--atol and --rtol compare rank by rank: across meshes, bits only")
    rows, first = compare_whole(meta_a, grads_a, meta_b, grads_b, ulp_distance)
    for label, meta, path in (("A", meta_a, args.a), ("B", meta_b, args.b)):
        print(f"{label}: {path}   ({meta['script']}, world size {meta['world_size']},"
              f" torch {meta['torch']})")
    print(f"whole gradients, {meta_a['steps']} steps, {len(rows)} parameters\n")
    print(tabulate(rows, headers=["parameter", "shape", "max abs diff", "max ulps",
                                  "elements differing", "bitwise equal", "first difference"],
                   disable_numparse=True))
    if first is None:
        print("\nverdict: IDENTICAL (every element of every whole gradient, bit for bit)")
        return 0
    step, name, index, a, b, ulps = first
    print(f"\nfirst difference: step {step}, {name!r}, element {list(index)}: {a!r} (A) vs"
          f" {b!r} (B), {ulps} units in the last place apart")
    print("verdict: DIFFERENT")
    return 1


if __name__ == "__main__":
    sys.exit(main())
