"""Break tensor parallelism and see: tp/parallel.py with one piece done wrong, against stock's.

    torchrun --nproc_per_node=2 examples/break_tp.py --break all     # each break in turn
    torchrun --nproc_per_node=2 examples/break_tp.py --break bias-every-rank
    torchrun --nproc_per_node=2 examples/break_tp.py --break bias-after --grad-table runs/btp.txt
    minddp diff runs/btp-bias-after-minddp.txt runs/btp-bias-after-stock.txt   # names the order

An MLP whose middle is split (a replicated first layer, then a column split and a row split)
trains 3 AdamW steps on the same batches twice: under stock's parallelize_module and under
minddp's with one piece patched (the library itself stays unbroken). After each step every
rank compares its output and every weight with stock's; the first step where they part and
by how much is the verdict. docs/tp.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "bias-every-rank": "the row split's whole bias added on every rank before the all_reduce",
    "no-input-allreduce": "copy_to_ranks' backward does not all_reduce the input's gradient",
    "bias-after": "the textbook: the row split's bias added once, after the all_reduce",
}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="all", choices=[*BREAKS, "all"])
    parser.add_argument("--grad-table", metavar="PATH",
                        help="write PATH-<break>-minddp.txt and PATH-<break>-stock.txt")
    args = parser.parse_args()

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import parallel as stock_tp

import minddp.tp as minddp_tp
import minddp.tp.ops as tp_ops
from minddp import GradTable, ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0


class MLP(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed, self.up, self.down = (torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, 8 * d),
                                          torch.nn.Linear(8 * d, d))

    def forward(self, x):
        return self.down(F.gelu(self.up(torch.tanh(self.embed(x)))))


def broken_forward(style, module, x, group):
    """RowwiseParallel's forward, with the bias added the broken ways."""
    partial = F.linear(x, module.weight)
    if broken == "bias-every-rank":  # every rank adds all of it: the sum holds it W times
        return tp_ops.sum_over_ranks(partial + module.bias, group)
    return tp_ops.sum_over_ranks(partial, group) + module.bias  # "bias-after"


def run(env, mesh, steps=3):
    torch.manual_seed(0)
    base = MLP()
    models = {}
    for who, tp in (("stock", stock_tp), ("minddp", minddp_tp)):
        models[who] = copy.deepcopy(base)
        tp.parallelize_module(models[who], mesh, {"up": tp.ColwiseParallel(),
                                                  "down": tp.RowwiseParallel()})
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    root, ext = os.path.splitext(args.grad_table or "")
    tables = {k: GradTable(m, args.grad_table and f"{root}-{broken}-{k}{ext or '.txt'}")
              for k, m in models.items()}  # whole gradients, for the diff tool
    verdict = f"every output and weight equal to stock's after {steps} steps, bit for bit"
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))  # the same on all
        outs = {}
        for who, model in models.items():
            optimizers[who].zero_grad()
            outs[who] = model(x)
            (outs[who] ** 2).mean().backward()
            tables[who].record()
            optimizers[who].step()
        weights = {who: [p.to_local() if hasattr(p, "to_local") else p for p in m.parameters()]
                   for who, m in models.items()}
        gaps = [(a.detach() - b.detach()).abs().max().item()
                for a, b in zip(weights["stock"], weights["minddp"])]
        out_gap = (outs["stock"] - outs["minddp"]).abs().max().item()
        if (out_gap or any(gaps)) and verdict.startswith("every"):
            ulps = out_gap / (torch.finfo(torch.float32).eps * outs["stock"].abs().max().item())
            names = [n for n, _ in models["minddp"].named_parameters()]
            why = ("forward is right, the gradients are not" if out_gap == 0
                   else "a different summation order, not a wrong result" if ulps <= 16
                   else _bias_factor(outs, base, env.world_size) if step == 0 else "")
            verdict = (f"parts from stock at step {step}: output off by {out_gap:.3g}"
                       # (3 digits when large: the last bit of the output's largest value,
                       # which sets the unit, differs between CPUs)
                       f" ({f'{ulps:.1f}' if ulps < 100 else f'{ulps:.3g}'} rounding units)"
                       f"{': ' + why if why else ''}; weights by up"
                       f" to {max(gaps):.3g} ({names[gaps.index(max(gaps))]}); the replicated"
                       f" embed.weight {_replicas(models['minddp'].embed.weight)}")
    for table in tables.values():
        table.save()  # collective
    return verdict


def _bias_factor(outs, base, world_size):
    extra = (outs["minddp"] - outs["stock"]).detach() / base.down.bias.detach()
    if torch.allclose(extra, torch.full_like(extra, world_size - 1.0), rtol=1e-3):
        return f"the bias is in it {world_size} times, once per rank"
    return ""


def _replicas(weight):
    """Collective: do all ranks still hold the same replicated weight?"""
    everyone = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, weight.detach())
    same = all(torch.equal(everyone[0], w) for w in everyone)
    return "still the same on every rank" if same else "now differs between ranks"


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        env = ddp_setup("gloo", "cpu")
        mesh = init_device_mesh("cpu", (env.world_size,))
        saved = dict(vars(minddp_tp.RowwiseParallel)), dict(vars(tp_ops._CopyToRanks))
        for broken in (BREAKS if args.broken == "all" else [args.broken]):
            if broken in ("bias-every-rank", "bias-after"):
                minddp_tp.RowwiseParallel._forward = broken_forward
            if broken == "no-input-allreduce":
                tp_ops._CopyToRanks.backward = staticmethod(lambda ctx, grad: (grad, None))
            print0(f"--break {broken}: {BREAKS[broken]}")
            print0(f"    {run(env, mesh)}")
            minddp_tp.RowwiseParallel._forward = saved[0]["_forward"]  # unbroken again
            tp_ops._CopyToRanks.backward = saved[1]["backward"]
        del mesh
        ddp_teardown()
