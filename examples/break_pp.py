"""Break the pipeline and see: minddp/pp/stage.py with one piece done wrong, against stock's.

    torchrun --nproc_per_node=2 examples/break_pp.py --break loss-undivided --grad-table r.txt
    minddp diff r-minddp.txt r-stock.txt                      # names the factor: 4.000x
    torchrun --nproc_per_node=2 examples/break_pp.py --break missing-recv
    torchrun --nproc_per_node=2 examples/break_pp.py --break deadlock --timeout 10
    torchrun --nproc_per_node=2 examples/break_pp.py --break w-before-i        # --pp stock too
    torchrun --nproc_per_node=2 examples/break_pp.py --break v-on-loop --timeout 10

An 8-layer MLP, one stage per rank, 4 microbatches, 3 AdamW steps, twice on the same
batches: with stock's ScheduleGPipe and with minddp's, one piece patched (the library itself
stays unbroken). After each step every rank compares its stage's gradients and weights with
stock's; the first step where they part and by how much is the verdict. The last two breaks
run two stages per rank from broken lists of actions, given to minddp's zero-bubble runner
or (--pp stock) to stock's; each fails at step 0, and says where. docs/pp.md shows the
output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "loss-undivided": "the summed gradients not divided by the number of microbatches",
    "missing-recv": "the last stage skips the recv of microbatch 1's activation (reuses 0's)",
    "deadlock": "stage 0 runs 1F1B's order with one warm-up forward, the last stage GPipe's",
    "w-before-i": "zero bubble (ZB1P, 2 stages per rank): the last stage's W0 moved before its I0",
    "v-on-loop": "ZBV's lists with the V's stages relabelled onto a loop's (rank r: r and r + p)",
}
LISTS = ("w-before-i", "v-on-loop")  # breaks of the lists: --pp says whose runner gets them

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="none", choices=list(BREAKS))
    parser.add_argument("--grad-table", metavar="PATH",
                        help="write PATH-minddp.txt and PATH-stock.txt (gradients per stage)")
    parser.add_argument("--pp", default="minddp", choices=["minddp", "stock"],
                        help=f"whose schedule runs the broken lists of {', '.join(LISTS)}")
    parser.add_argument("--timeout", type=float, default=30, metavar="S",
                        help="seconds a stage waits in recv before failing")
    args = parser.parse_args()

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import pipelining as stock_pp

from minddp import (GradTable, UsageError, ddp_setup, ddp_teardown, exit_on_failure,
                    exit_on_usage_error, print0, print_rank)
from minddp import pp
from minddp.pp.v_shaped import zbv
from minddp.pp.zero_bubble import add_bubbles
from minddp.pp.interleaved import interleaved_1f1b

N = 4  # microbatches


class Undivided(pp.ScheduleGPipe):
    def step(self, *args, **kwargs):
        result = super().step(*args, **kwargs)
        for p in self.stage.submod.parameters():  # the break: undo the division by N
            p.grad.mul_(N)
        return result


class MissingRecv(pp.PipelineStage):
    def forward_one(self, i, x=None):
        if i == 1 and not self.is_first:  # the break: no recv, microbatch 0's input again
            output = self.submod(self.inputs_0)
            self.inputs[i], self.outputs[i] = self.inputs_0, output
            self.log.append(f"F{i}")
            return output
        output = super().forward_one(i, x)
        if i == 0:
            self.inputs_0 = self.inputs[0]
        return output


def runner_for(stage, broken):
    if broken == "loss-undivided":
        return Undivided(stage, N, loss_fn=F.mse_loss)
    if broken == "deadlock":
        order = pp.one_f_one_b if stage.is_first else pp.gpipe
        runner = pp.Schedule(stage, N, loss_fn=F.mse_loss)
        runner.actions = lambda s, p, n: ([("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                           ("B", 2), ("F", 3), ("B", 3)] if stage.is_first
                                          else order(s, p, n))
        return runner
    return pp.ScheduleGPipe(stage, N, loss_fn=F.mse_loss)


def broken_lists(broken, p):
    """Every rank's list of actions ("sFi", None: a wait), broken: 2 stages per rank, a loop."""
    if broken == "w-before-i":  # ZB1P's lists; on the last rank (the last stage's) a W first
        lists = add_bubbles([interleaved_1f1b(r, p, 2, N, zero_bubble=True) for r in range(p)],
                            2 * p)
        last = lists[p - 1]
        last.insert(last.index(f"{2 * p - 1}I0"), last.pop(last.index(f"{2 * p - 1}W0")))
        return lists
    # ZBV's: rank r holds stages r and 2p-1-r. Relabel the second to the loop's r + p, on the
    # same rank: each rank's order is the V's, its stages a loop's.
    return [[a and (a if int(a[:-2]) < p else f"{3 * p - 1 - int(a[:-2])}{a[-2:]}")
             for a in zbv(r, p, N)] for r in range(p)]


HINT = "every I and W after its F, every W after its I, the stages placed as the lists assume"


def run_lists(env, broken, group, who, steps=3):
    """The broken lists run by minddp's zero-bubble runner, or by stock's (--pp stock)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])
    p, num_stages = env.world_size, 2 * env.world_size
    mine = [env.rank, env.rank + p]  # a loop
    lists = broken_lists(broken, p)
    if who == "minddp":
        stages = [pp.PipelineStage(pp.stage_layers(model, s, num_stages), s, num_stages,
                                   group=group) for s in mine]
        runner = pp.ScheduleInterleavedZeroBubble(stages, N, loss_fn=F.mse_loss)
        runner.order = lambda: runner.parsed(lists[env.rank])  # the break: its own lists
    else:
        from torch.distributed.pipelining.schedules import _Action
        stages = [stock_pp.PipelineStage(pp.stage_layers(model, s, num_stages), s, num_stages,
                                         torch.device("cpu")) for s in mine]
        runner = stock_pp.ScheduleInterleavedZeroBubble(stages, N, loss_fn=F.mse_loss)
        try:  # stock's way to run lists of its own: it adds the sends and recvs, checking
            runner._prepare_schedule_with_comms(
                {r: [a and _Action.from_str(a) for a in acts] for r, acts in enumerate(lists)})
        except AssertionError as e:  # every rank's lists, checked before any rank runs
            raise UsageError(f"stock refused the lists before step 0:"
                             f" {str(e).splitlines()[0]}", same_on_every_rank=True,
                             hint=HINT) from None
    print0(f"rank 0 runs {' '.join(filter(None, lists[0][:12]))} ...;"
           f" rank {p - 1} {' '.join(filter(None, lists[p - 1][:12]))} ...")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
        optimizer.zero_grad()
        try:
            runner.step(*([x] if env.rank == 0 else []),
                        target=y if env.rank == p - 1 else None)
        except UsageError:
            raise  # minddp's own refusal: one line already
        except (RuntimeError, AssertionError) as e:  # stock's refusal, or a recv never met
            why = str(e).splitlines()[0].split("] ")[-1]
            raise UsageError(f"stages {mine[0]}, {mine[1]} of {num_stages} ({who}) stuck at step"
                             f" {step}: {why[:110]}", hint=HINT) from None
        optimizer.step()
    return f"stages {mine[0]}, {mine[1]}: {steps} steps run"


def run(env, broken, group, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])
    models = {who: copy.deepcopy(model) for who in ("stock", "minddp")}
    layers = {who: pp.stage_layers(m, env.rank, env.world_size) for who, m in models.items()}
    stage_cls = MissingRecv if broken == "missing-recv" else pp.PipelineStage
    runners = {"stock": stock_pp.ScheduleGPipe(stock_pp.PipelineStage(
                   layers["stock"], env.rank, env.world_size, torch.device("cpu")), N,
                   loss_fn=F.mse_loss),
               "minddp": runner_for(stage_cls(layers["minddp"], env.rank, env.world_size,
                                              group=group), broken)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in layers.items()}
    root, ext = os.path.splitext(args.grad_table or "")
    tables = {k: GradTable(m, args.grad_table and f"{root}-{k}{ext or '.txt'}")
              for k, m in models.items()}  # the other stages' rows: NaN on both sides
    verdict = f"stage {env.rank}: every gradient and weight equal to stock's after {steps} steps"
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
        for who, runner in runners.items():
            optimizers[who].zero_grad()
            try:
                runner.step(*([x] if env.rank == 0 else []),
                            target=y if env.rank == env.world_size - 1 else None)
            except RuntimeError as e:  # a recv that never completes: name the stage
                why = str(e).splitlines()[0].split("] ")[-1]  # gloo's words, less its path
                raise UsageError(f"stage {env.rank} of {env.world_size} ({who}) stuck at step"
                                 f" {step}: {why[:110]}",
                                 hint="each stage's order must let every recv meet its send:"
                                      " compare the stages' F/B lists") from None
            tables[who].record()
            optimizers[who].step()
        ratio = [(a.grad / b.grad).flatten() for a, b in zip(layers["minddp"].parameters(),
                                                             layers["stock"].parameters())]
        gaps = [(a - b).abs().max().item() for a, b in zip(layers["minddp"].parameters(),
                                                           layers["stock"].parameters())]
        if any(gaps) and verdict.endswith("steps"):
            ratio = torch.cat(ratio)
            factor = (f"; gradients {ratio.median():.3f}x stock's" if torch.allclose(
                ratio, ratio.median().expand_as(ratio), rtol=1e-4) else "")
            verdict = (f"stage {env.rank}: parts from stock at step {step}: weights off by up to"
                       f" {max(gaps):.3g}{factor}")
    for table in tables.values():
        table.save()  # collective
    return verdict


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        env = ddp_setup("gloo", "cpu", args.timeout)
        print0(f"--break {args.broken}: {BREAKS[args.broken]}")
        # minddp's stages talk in a group of their own: a message the break leaves unread
        # cannot be taken by stock's run on the same ranks.
        group = dist.new_group(list(range(env.world_size)), timeout=timedelta(seconds=args.timeout))
        if args.broken in LISTS:
            print_rank(f"    {run_lists(env, args.broken, group, args.pp)}")
        else:
            print_rank(f"    {run(env, args.broken, group)}")
        dist.destroy_process_group(group)
        del group  # the last reference: its threads end with it, before the teardown's check
        ddp_teardown()
