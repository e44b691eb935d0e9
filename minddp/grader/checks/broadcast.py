"""The broadcast's check: broadcast_parameters against rank src's own values.

    minddp grade exercises/broadcast.py      # grade.py runs CHECKS["broadcast"] on every rank

Every rank its own parameters (one of them frozen) and buffers: src 0, the last rank,
buffers=False, and (3+ ranks) a group without global rank 0. Each check runs on every rank,
gathers what every rank saw, and returns the same results on each: [{"check", "passed",
"where", "diagnosis"}], the first difference and why.
"""

import torch
import torch.distributed as dist

from ..shared.training import _everyone, _ranks, _result


def broadcast(student, rank, world_size):
    """broadcast_parameters: each case's parameters and buffers against rank src's own."""
    others = dist.new_group(list(range(1, world_size)))  # a group without global rank 0
    cases = [("src=0", dict(src=0), None, list(range(world_size))),
             (f"src={world_size - 1}", dict(src=world_size - 1), None, list(range(world_size))),
             ("src=0, buffers=False", dict(src=0, buffers=False), None, list(range(world_size))),
             (f"a group of ranks 1-{world_size - 1}, src=0 (global rank 1)",
              dict(src=0, group=others), others, list(range(1, world_size)))][
        :4 if world_size > 2 else 3]  # (a group without rank 0 needs 3 ranks or more)
    results = []
    for label, kwargs, group, members in cases:
        torch.manual_seed(rank)  # every rank its own values
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        model[1].running_mean.fill_(rank)
        model[0].bias.requires_grad_(False)  # frozen: stock's DDP broadcasts it too
        before = {n: t.clone() for n, t in model.state_dict().items()}
        if rank in members:
            student.broadcast_parameters(model, **kwargs)
        after = {n: t.clone() for n, t in model.state_dict().items()}
        everyone = _everyone((before, after))
        src = members[kwargs["src"]]  # the group rank's global rank
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        verdict = _broadcast_verdict(everyone, members, src, kwargs.get("buffers", True),
                                     dict(model.named_buffers()), frozen)
        results.append(_result(f"{_ranks(world_size)}, {label}", *verdict))
    return results


def _broadcast_verdict(everyone, members, src, buffers, buffer_names, frozen):
    for rank in members:
        before, after = everyone[rank]
        for name, value in after.items():
            is_buffer = name in buffer_names
            wanted = everyone[src][0][name] if buffers or not is_buffer else before[name]
            if torch.equal(value, wanted):
                continue
            where = f"rank {rank}, {name}"
            holder = next((r for r in range(len(everyone))
                           if torch.equal(value, everyone[r][0][name])), None)
            if is_buffer and not buffers:
                return False, where, "a buffer was copied, though buffers=False"
            if holder == rank:
                return False, where, (f"rank {rank} still holds its own {name}: nothing was"
                                      f" copied into it, in place (the optimizer holds these"
                                      f" very tensors)" + (" (buffers count too)"
                                                            if is_buffer else
                                                            " (a frozen parameter too)"
                                                            if name in frozen else ""))
            if holder is not None:
                return False, where, (f"rank {rank} holds rank {holder}'s {name}, not rank"
                                      f" {src}'s: src is a rank of the group; send it with its"
                                      f" global rank (groups.global_rank)")
            return False, where, f"rank {rank} holds values of {name} no rank had"
    return True, "", ""
