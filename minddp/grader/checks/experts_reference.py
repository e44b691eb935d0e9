"""Expert parallelism's reference: one process on the whole batch, as each rank computes it.

    minddp grade exercises/experts.py        # checks/experts.py runs it beside the student's

The cases (dp, top_k, capacity factor per world size), each rank's tokens (6 + 2 rank: uneven
splits), and one step of the MoE layer in one process on every rank's tokens
(minddp/references/moe.py), each expert run once per ep group on the rows in the order
(source rank, token), as tests/test_experts.py does. The replicated weights are averaged by
the same gloo all_reduce of the same rank parts the student's sync makes.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...references.moe import one_process_moe, rank_order_sum
from ..shared.training import _np


STEPS = 2
NUM_EXPERTS = 8
# (dp, top_k, capacity_factor) per world size: pure ep and dp x ep, top-1 and top-2,
# dropless and with a capacity (the first C pairs of each expert kept).
CASES = {1: [(1, 2, None)], 2: [(1, 1, None), (1, 2, 1.25)],
         4: [(1, 2, 1.25), (2, 2, None), (2, 1, 1.0)]}


def _tokens(rank, step):
    """Rank r's tokens and targets at a step: 6 + 2r of them, its own seed."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6 + 2 * rank, 8, generator=g), torch.randn(6 + 2 * rank, 8, generator=g)


def _keep_rows(rows, expert):
    """A forward hook keeping the first rows `expert` is given (it returns None: a hook that
    returned them would replace the expert's output)."""
    def hook(module, args, output):
        rows.setdefault(expert, _np(args[0]))
    return hook


def _reference_step(master, rank, world_size, dp, step, mine, reference):
    """One process on every rank's tokens (references/moe.py): this rank's part of it, and
    master's gradients set to the synchronized reference's."""
    ep = world_size // dp
    data = [_tokens(r, step) for r in range(world_size)]
    xs = [d[0].clone().requires_grad_() for d in data]
    routers = [copy.deepcopy(master.router) for _ in range(world_size)]
    held = [copy.deepcopy(master.experts) for _ in range(dp)]
    rows = {}
    if step == 0:
        for e in mine:
            held[rank // ep].mlps[str(e)].register_forward_hook(_keep_rows(rows, e))
    outs, balances, counts = one_process_moe(routers, held, master, xs, ep)
    torch.autograd.backward([F.mse_loss(o, d[1]) + 0.01 * b
                             for o, d, b in zip(outs, data, balances)])
    names = [n for n, _ in master.named_parameters()]
    local = {"router.weight": routers[rank].weight.grad.clone()}
    for name, p in held[rank // ep].named_parameters():
        local[f"experts.{name}"] = p.grad
    # The replicated weights: the same gloo all_reduce of the same rank parts as the
    # student's sync makes; an expert's: over the ep groups in group order (dp is 1 or 2,
    # where gloo's sum is a + b too); each divided by W.
    router = routers[rank].weight.grad.clone()
    dist.all_reduce(router)
    master.router.weight.grad = router / world_size
    for name, p in master.experts.named_parameters():
        p.grad = rank_order_sum([dict(h.named_parameters())[name].grad
                                 for h in held]) / world_size
    grads = {n: _np(p.grad) for n, p in master.named_parameters()}
    if step == 0:
        reference["rows"] = rows
        reference["counts"] = [c.tolist() for c in counts]
    reference["steps"].append({"(output)": _np(outs[rank]),
                               "(the input's gradient)": _np(xs[rank].grad),
                               "local": {n: _np(g) for n, g in local.items()},
                               "grads": {n: grads[n] for n in names}})
