"""The expert-parallel check: the student's experts on ranks beside one process on the whole
batch (minddp/references/moe.py), bit for bit.

    minddp grade exercises/experts.py        # grade.py runs CHECKS["experts"] on every rank

One MoE layer (8 experts, ep/experts.py) under the student's expert_parallel, each rank its
own number of tokens (6 + 2 rank: uneven splits), 2 AdamW steps after the student's
sync_gradients; beside it the layer in one process on every rank's tokens
(experts_reference.py). Compared (experts_verdict.py): the rows each expert is given (step
0), each rank's output, the input's gradient, every gradient before and after
sync_gradients, and every weight after the step. A right sync_gradients is the reference's
bits at every world size. Every all_to_all_single is checked first on every rank of its
group (experts_routing.py): splits that the ranks do not agree on are named on every rank
alike, where gloo would wait.
"""

import copy

import torch
import torch.nn.functional as F

from ...ep.experts import MoE
from ..shared.training import _everyone, _np, _ranks, _result
from .experts_reference import CASES, NUM_EXPERTS, STEPS, _keep_rows, _reference_step, _tokens
from .experts_routing import _Splits, _agreed_splits
from .experts_verdict import _verdict


def experts(student, rank, world_size):
    """Each case of CASES[world_size]: the student's layer beside one process, STEPS steps."""
    results = []
    for dp, top_k, capacity in CASES[world_size]:
        label = (f"{_ranks(world_size)}, " + (f"dp={dp} x ep={world_size // dp}" if dp > 1 else
                                             f"ep={world_size}")
                 + f", top-{top_k}, " + ("dropless" if capacity is None else
                                         f"capacity factor {capacity}") + ", AdamW")
        record = _case(student, rank, world_size, dp, top_k, capacity)
        everyone = _everyone(record)
        results.append(_result(label, *_verdict(everyone, world_size, dp)))
    return results


def _case(student, rank, world_size, dp, top_k, capacity):
    """This rank's record of one case: {"yours", "reference"}; or, where a rank's all_to_all
    splits disagreed or autograd refused a gradient, what it saw ("splits", "raised")."""
    from ...mesh.device_mesh import init_device_mesh
    torch.manual_seed(0)
    layer = MoE(8, 16, NUM_EXPERTS, top_k=top_k, capacity_factor=capacity)
    master = copy.deepcopy(layer)
    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "ep"))
    student.expert_parallel(layer, mesh)
    mine = [int(e) for e in layer.experts.mlps] if hasattr(layer.experts, "mlps") else []
    seen_rows = {}
    for e in mine:  # the rows each of this rank's experts is given, at step 0
        layer.experts.mlps[str(e)].register_forward_hook(_keep_rows(seen_rows, e))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
                  for m in (layer, master)]
    yours, reference = {"steps": [], "rows": seen_rows}, {"steps": [], "rows": {}}
    for step in range(STEPS):
        # The reference first, on every rank alike (its all_reduce is the world's): a rank
        # whose student code fails below still has it, and no rank is left waiting in it.
        _reference_step(master, rank, world_size, dp, step, mine, reference)
        x, target = _tokens(rank, step)
        x.requires_grad_()
        out, failed, calls, phase = None, None, [], "the forward"
        try:
            with _agreed_splits(calls):
                out = layer(x)
                phase = "the backward"
                (F.mse_loss(out, target) + 0.01 * layer.balance_loss).backward()
        except _Splits as error:
            failed = {"splits": (step, phase, len(calls), error.seen)}
        except RuntimeError as error:
            if "returned an invalid gradient" not in str(error):
                raise
            # autograd refuses a gradient of another shape than the rows it is for
            failed = {"raised": (step, str(error).splitlines()[0])}
        # Every rank learns whether one failed, so that all stop here together.
        if any(_everyone(failed is not None)):
            return {**(failed or {"stopped": step}), "output": _np(out),
                    "reference": reference}
        local = {n: _np(p.grad) for n, p in layer.named_parameters()}
        student.sync_gradients(layer, mesh)
        yours["steps"].append({"(output)": _np(out), "(the input's gradient)": _np(x.grad),
                               "local": local,
                               "grads": {n: _np(p.grad) for n, p in layer.named_parameters()}})
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    theirs = {n: _np(p) for n, p in master.named_parameters()}
    yours["weights"] = {n: _np(p) for n, p in layer.named_parameters()}
    reference["weights"] = {n: theirs[n] for n in yours["weights"]}
    return {"yours": yours, "reference": reference}
