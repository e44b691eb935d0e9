"""Break expert parallelism and see: ep/parallel.py with one piece wrong, against one process.

    torchrun --nproc_per_node=2 examples/break_experts.py --break all     # each break in turn
    torchrun --nproc_per_node=2 examples/break_experts.py --break no-weights
    torchrun --nproc_per_node=2 examples/break_experts.py --break unsorted --grad-table runs/bep.txt
    minddp diff runs/bep-unsorted-minddp.txt runs/bep-unsorted-reference.txt   # names the step

The MoE GPT (examples/experts.py's: 4 experts, top-2, every rank its own sequences) trains 3
AdamW steps twice on the same batches: as one process on every rank's batch
(references/moe.py) and under minddp's expert parallelism with one piece patched (the
library itself stays unbroken). After each step every rank compares its loss and every
weight with one process's; the first step where they part and by how much is the verdict.
docs/experts.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "no-weights": "the experts' outputs summed without the router's weights",
    "unsorted": "the experts' outputs handed back in expert order, not put back in token order",
    "summed": "the experts' gradients summed over the ranks' losses, not averaged (not / W)",
}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="all", choices=[*BREAKS, "all"])
    parser.add_argument("--grad-table", metavar="PATH",
                        help="write PATH-<break>-minddp.txt and PATH-<break>-reference.txt")
    args = parser.parse_args()

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minddp.ep.experts as experts
from minddp import GradTable, ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0
from minddp.bench.transformer import moe_gpt
from minddp.ep.parallel import ExpertsOnRanks, expert_parallel, sync_gradients
from minddp.mesh.device_mesh import init_device_mesh
from minddp.references.moe import OneProcessMoEGPT

UNBROKEN = {"combine": experts.combine}


def unweighted(outputs, kept, weights, num_tokens):
    """The broken combine: a token's k outputs added as they are."""
    return UNBROKEN["combine"](outputs, kept, torch.ones_like(weights), num_tokens)


def unsorted(outputs, kept, weights, num_tokens):
    """The broken combine: outputs (in expert order) laid down in pair order as they come."""
    return UNBROKEN["combine"](outputs, kept.sort().values, weights, num_tokens)


def summed(model, mesh):
    """The broken sync: the experts' gradients left W times too large."""
    sync_gradients(model, mesh)
    for m in model.modules():
        if isinstance(m, ExpertsOnRanks):
            for p in m.parameters():
                p.grad *= mesh.size()


def run(env, mesh, steps=3):
    torch.manual_seed(0)
    model = moe_gpt(experts=4, top_k=2)
    reference = copy.deepcopy(model)
    root, ext = os.path.splitext(args.grad_table or "")
    tables = {who: GradTable(m, args.grad_table and f"{root}-{broken}-{who}{ext or '.txt'}")
              for who, m in (("minddp", model), ("reference", reference))}
    expert_parallel(model, mesh)
    one_process = OneProcessMoEGPT(reference, env.world_size, env.world_size)
    optimizers = {who: torch.optim.AdamW(m.parameters(), lr=1e-2)
                  for who, m in (("minddp", model), ("reference", reference))}
    verdict = f"every loss and weight equal to one process's after {steps} steps, bit for bit"
    for step in range(steps):
        data = []
        for r in range(env.world_size):  # every rank its own sequences
            tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(
                10 * step + r))
            data.append((tokens[:, :-1], tokens[:, 1:]))
        x, y = data[env.rank]
        logits = model(x)
        balance = sum(block.mlp.balance_loss for block in list(model)[1:-1])
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.01 * balance
        loss.backward()
        (summed if broken == "summed" else sync_gradients)(model, mesh)
        losses = one_process.losses([d[0] for d in data], [d[1] for d in data], 0.01)
        torch.autograd.backward(losses)
        for name, grad in one_process.gradients().items():
            dict(reference.named_parameters())[name].grad = grad
        for who in tables:
            tables[who].record()
            optimizers[who].step()
            optimizers[who].zero_grad()
        theirs = dict(reference.named_parameters())
        gaps = {name: (p - theirs[name]).abs().max().item() for name, p in model.named_parameters()}
        loss_gap = abs(loss.item() - losses[env.rank].item())
        if (loss_gap or any(gaps.values())) and verdict.startswith("every"):
            worst = max(gaps, key=gaps.get)
            verdict = (f"parts from one process at step {step}: loss off by {loss_gap:.3g} on"
                       f" rank {env.rank}; weights by up to {gaps[worst]:.3g} ({worst})")
    for table in tables.values():
        table.save()  # collective
    return verdict


def patch(broken):
    experts.combine = {"no-weights": unweighted, "unsorted": unsorted}.get(
        broken, UNBROKEN["combine"])


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        env = ddp_setup("gloo", "cpu")
        mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("ep",))
        for broken in (BREAKS if args.broken == "all" else [args.broken]):
            patch(broken)
            print0(f"--break {broken}: {BREAKS[broken]}")
            verdicts = [None] * env.world_size
            dist.all_gather_object(verdicts, run(env, mesh))
            for rank, verdict in enumerate(verdicts):
                print0(f"    rank {rank}: {verdict}")
            patch("none")  # unbroken again
        del mesh
        ddp_teardown()
