"""Why the ranks hang in a collective: what each one called it with, read side by side.

    minddp grade exercises/naive.py      # world.py notes each call; a hang is read here

A collective completes when every rank of its group calls it alike: the same group, the
same src, tensors of the same size. world.py notes, with each collective a rank enters,
its group, its src or dst and its tensors' sizes (details()); when ranks are still waiting
at the time limit, why() reads those notes across the ranks and names the first of these
that differs. None: nothing differs, and the report stays where each rank waits.
"""

import inspect

_SIGNATURES = {}  # per collective: made once, read at every call


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
    return noted


def why(waits, world_size, group=None):
    """The mismatch among the ranks still waiting, or None. `waits`: {rank: (collective,
    details, called from the student's file)} for each rank waiting in one, the others
    absent; `group`: the ranks of the group the check made last (dist.new_group), if any.
    Only the student's calls are read as the cause: the grader's own gathering is not."""
    group = group or []
    worldwide = sorted(r for r, (_, seen, mine) in waits.items()
                       if mine and seen.get("group", 0) is None and r in group)
    name = waits[worldwide[0]][0] if worldwide else None
    outside = [r for r in range(world_size) if r not in group]
    if worldwide and outside and not any(waits.get(r, ("",))[0] == name for r in outside):
        return (f"rank{'s' * (len(worldwide) > 1)} {_listed(worldwide)} of the group of ranks"
                f" {_listed(group)} wait{'s' * (len(worldwide) == 1)} in {name} on the whole"
                f" world (no group= given), which rank{'s' * (len(outside) > 1)}"
                f" {_listed(outside)}, outside the group, never"
                f" join{'s' * (len(outside) == 1)}:"
                f" a collective of the group's ranks needs group= (the process group), or it"
                f" waits for every rank")
    names = {name for name, _, _ in waits.values()}
    if len(waits) < world_size or len(names) != 1 or not all(m for _, _, m in waits.values()):
        return None
    name = names.pop()
    for key, what in (("group", "groups"), ("src", "src"), ("dst", "dst"),
                      ("sizes", "tensor sizes (elements)")):
        values = {rank: seen.get(key) for rank, (_, seen, _) in waits.items()}
        if len({repr(v) for v in values.values()}) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in sorted(values.items()))
            return (f"every rank waits in {name}, called with other {what}: {each}; a"
                    f" collective pairs up only when every rank calls it alike"
                    + (" (each rank takes part in every src's broadcast, in the same order)"
                       if key == "src" else " (pad the short one: gloo waits for equal sizes)"
                       if key == "sizes" else ""))
    return None


def _listed(ranks):
    return ", ".join(map(str, ranks))
