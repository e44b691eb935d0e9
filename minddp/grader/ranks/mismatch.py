"""Why the ranks hang in a collective: what each one called it with, read side by side.

    minddp grade exercises/naive.py      # world.py notes each call; a hang is read here

A collective completes when every rank of its group calls it alike: the same group, the
same src, tensors of the same size. world.py notes, with each collective a rank enters,
its group, its src or dst, its tensors' sizes and an all_to_all's splits (details()), and
the call's ordinal on its group. certain() reads the calls the ranks are inside every 50
ms: two ranks inside the same call of one group, called unlike, can never complete, and the
ranks are stopped then. why() reads those notes across the ranks and names the first of
these that differs. None: nothing differs, and the report stays where each rank waits.
"""

import inspect

_SIGNATURES = {}  # per collective: made once, read at every call
P2P = ("send", "recv", "batch_isend_irecv")  # a rank's own peers: no call of the group's
# whose tensors may differ in size from rank to rank (the splits, or pickled objects)
ANY_SIZE = ("all_to_all_single", "all_gather_object", "gather_object", "barrier")


def details(original, args, kwargs):
    """{"group": its global ranks or None (the whole world), "src"/"dst", "sizes": elements
    of each tensor given}: how this rank called the collective `original`."""
    try:  # a note only: the collective itself says what is wrong with its arguments
        return _details(original, args, kwargs)
    except Exception:
        return {}


def _details(original, args, kwargs):
    import torch  # here, not at the top: the grader's own process never imports torch
    import torch.distributed as dist
    if original not in _SIGNATURES:
        _SIGNATURES[original] = inspect.signature(original)
    bound = _SIGNATURES[original].bind(*args, **kwargs).arguments
    group = bound.get("group")
    noted = {"group": None if group is None or group is dist.group.WORLD
             else dist.get_process_group_ranks(group)}
    for key in ("src", "dst"):
        if bound.get(key) is not None:
            noted[key] = bound[key]
    tensors = [t for value in bound.values()
               for t in (value if isinstance(value, (list, tuple)) else [value])
               if isinstance(t, torch.Tensor)]
    noted["sizes"] = [t.numel() for t in tensors]
    if "output_split_sizes" in _SIGNATURES[original].parameters:  # all_to_all_single
        noted["rows"] = [int(bound["output"].shape[0]), int(bound["input"].shape[0])]
        noted["splits"] = [None if bound.get(k) is None else [int(n) for n in bound[k]]
                           for k in ("output_split_sizes", "input_split_sizes")]
    return noted


def certain(waits, world_size):
    """Whether some collective the ranks are inside can never complete, so that world.py
    stops them at once: two ranks inside the same call of one group (its ordinal, "call"),
    called unlike (another collective; another src or dst; tensors of other sizes;
    all_to_all splits that do not pair, read once every rank of the group is there).
    `waits` as why() reads it. A call that completed pairs up alike on every rank, so a rank
    still logged inside the call before (not yet noted done) never reads as this."""
    calls = {}
    for rank, (name, seen, mine) in waits.items():
        if name not in P2P and seen.get("call") is not None:
            key = repr((seen.get("group"), seen["call"]))
            calls.setdefault(key, {})[rank] = (name, seen, mine)
    for same in calls.values():
        if len({name for name, _, _ in same.values()}) > 1:
            return True
        members = next(iter(same.values()))[1].get("group") or list(range(world_size))
        if _unlike(same, whole=set(same) == set(members)) is not None:
            return True
    return False


def outside(waits, world_size, group=None):
    """The ranks of `group` waiting in a collective of the whole world (from the student's
    file) that no rank outside the group, each waiting elsewhere, joins: named, or None."""
    group = group or []
    worldwide = sorted(r for r, (_, seen, mine) in waits.items()
                       if mine and seen.get("group", 0) is None and r in group)
    name = waits[worldwide[0]][0] if worldwide else None
    others = [r for r in range(world_size) if r not in group]
    if worldwide and others and not any(waits.get(r, ("",))[0] == name for r in others):
        return (f"rank{'s' * (len(worldwide) > 1)} {_listed(worldwide)} of the group of ranks"
                f" {_listed(group)} wait{'s' * (len(worldwide) == 1)} in {name} on the whole"
                f" world (no group= given), which rank{'s' * (len(others) > 1)}"
                f" {_listed(others)}, outside the group, never"
                f" join{'s' * (len(others) == 1)}:"
                f" a collective of the group's ranks needs group= (the process group), or it"
                f" waits for every rank")
    return None


def why(waits, world_size, group=None):
    """The mismatch among the ranks still waiting, or None. `waits`: {rank: (collective,
    details, called from the student's file)} for each rank waiting in one, the others
    absent; `group`: the ranks of the group the check made last (dist.new_group), if any.
    Only the student's calls are read as the cause: the grader's own gathering is not."""
    named = outside(waits, world_size, group)
    if named:
        return named
    names = {name for name, _, _ in waits.values()}
    if len(waits) < world_size or len(names) != 1 or not all(m for _, _, m in waits.values()):
        return None
    return _unlike(waits)


def _unlike(waits, whole=True):
    """What differs among the calls of one collective the ranks of `waits` wait in, or None;
    whole: every rank of its group is among them (all_to_all's splits are read only then)."""
    name = next(iter(waits.values()))[0]
    if name in P2P:  # each rank its own peer: no call to be alike
        return None
    for key, what in (("group", "groups"), ("src", "src"), ("dst", "dst"),
                      ("sizes", "tensor sizes (elements)")):
        if key == "sizes" and name in ANY_SIZE:
            continue
        values = {rank: seen.get(key) for rank, (_, seen, _) in waits.items()}
        if len({repr(v) for v in values.values()}) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in sorted(values.items()))
            return (f"every rank waits in {name}, called with other {what}: {each}; a"
                    f" collective pairs up only when every rank calls it alike"
                    + (" (each rank takes part in every src's broadcast, in the same order)"
                       if key == "src" else " (pad the short one: gloo waits for equal sizes)"
                       if key == "sizes" else ""))
    if name == "all_to_all_single" and whole:
        return _splits_apart(waits)
    return None


def _splits_apart(waits):
    """all_to_all_single: rank i's input split j must be rank j's output split i (None: the
    rows cut evenly)."""
    ranks = sorted(waits)
    try:
        cut = {r: [s if s is not None else [rows // len(ranks)] * len(ranks) for s, rows in
                   zip(waits[r][1]["splits"], waits[r][1]["rows"])] for r in ranks}
    except (KeyError, TypeError):
        return None
    for i, r in enumerate(ranks):
        for j, q in enumerate(ranks):
            sent, expected = cut[r][1], cut[q][0]
            if len(sent) != len(ranks) or len(expected) != len(ranks):
                return (f"every rank waits in all_to_all_single; rank {r}'s splits"
                        f" {cut[r]} (output, input) are not one per rank of the group")
            if sent[j] != expected[i]:
                return (f"every rank waits in all_to_all_single, with splits that do not pair"
                        f" up: rank {r} sends rank {q} {sent[j]} rows, rank {q} expects"
                        f" {expected[i]} from it (each rank's input_split_sizes[j] must be"
                        f" rank j's output_split_sizes[i], counted in rows)")
    return None


def _listed(ranks):
    return ", ".join(map(str, ranks))
