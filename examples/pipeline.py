"""Pipeline parallelism: the lesson's model cut into stages, one per rank, microbatches through.

    torchrun --nproc_per_node=2 examples/pipeline.py --grad-table runs/pp.txt
    torchrun --nproc_per_node=2 examples/pipeline.py --pp stock --grad-table runs/pp-stock.txt
    minddp diff runs/pp.txt runs/pp-stock.txt          # IDENTICAL (also with --schedule gpipe)
    torchrun --nproc_per_node=2 examples/pipeline.py --schedule zbv --grad-table runs/zbv.txt

examples/manual_ddp.py with the wrapper replaced: rank s holds stage s of the model's layers
(minddp/pp/stage.py; docs/pp.md), e.g. at 2 ranks Linear(2, 30), ReLU, Linear(30, 20) on rank 0
and ReLU, Linear(20, 2) on rank 1. Every rank walks the same batches; each batch of 4 is cut
into --microbatches pieces that flow forward and back in the --schedule's order, which rank
prints for the first batch. The last stage computes the loss; a gradient table holds each
rank's own stage (the other stages' weights, which have no gradient there, as NaN).
--schedule interleaved-1f1b, looped-bfs, zb1p, zbv and dualpipev run 2 stages per rank
(pp/interleaved.py, pp/zero_bubble.py, pp/v_shaped.py): the model gets Linear(20, 20) and ReLU
before its last layer until each of the 2 x ranks stages holds one (at 2 ranks: one pair);
zbv and dualpipev place them in a V (rank 0 holds the first and the last stage), and
dualpipev needs --microbatches of at least 2 x ranks.
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = parse_checked(lesson_parser(__doc__, pp=True)) if __name__ == "__main__" else None

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, ddp_setup, ddp_teardown, exit_on_failure,
                    exit_on_usage_error, print0, print_rank, toy_datasets)
from minddp import ShardSampler
import minddp.pp as minddp_pp
from torch.distributed import pipelining as stock_pp
from minddp.pp.interleaved import loop_placement
from minddp.pp.v_shaped import v_placement
from minddp.run import older_torch  # noqa: F401  (torch 2.11 and 2.12: stock's stages as 2.13's)

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",  # --schedule: the class
             "interleaved-1f1b": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
             "zb1p": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}
VIRTUAL = list(SCHEDULES)[2:]  # 2 stages per rank


def main(env, args):
    torch.manual_seed(args.seed)  # the same seed on every rank: same data, same first weights
    train_ds, _ = toy_datasets(args.factor)
    train_loader = DataLoader(
        dataset=train_ds, batch_size=4, shuffle=False,  # the sampler shuffles, per epoch
        pin_memory=env.device.type == "cuda", drop_last=True,
        sampler=ShardSampler(train_ds, num_replicas=1, rank=0))  # every rank all of it

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    num_stages = env.world_size * (2 if args.schedule in VIRTUAL else 1)
    while sum(isinstance(m, torch.nn.Linear) for m in model.layers) < num_stages:
        # 2 stages per rank need more layers with weights than the lesson's 3: one more
        # Linear(20, 20) and ReLU before the last layer, until each stage holds one
        model.layers.insert(-1, torch.nn.ReLU())
        model.layers.insert(-2, torch.nn.Linear(20, 20).to(env.device))
    place = v_placement if args.schedule in ("zbv", "dualpipev") else loop_placement
    mine = [s for s in range(num_stages) if place(s, env.world_size) == env.rank]
    stages = [minddp_pp.stage_layers(model.layers, s, num_stages) for s in mine]  # this rank's
    pp = minddp_pp if args.pp == "manual" else stock_pp
    built = [pp.PipelineStage(layers, s, num_stages, env.device) for layers, s in zip(stages, mine)]
    log = []  # stock's actions as they run
    if args.pp == "stock":
        log_actions(built, log)
    schedule = getattr(pp, SCHEDULES[args.schedule])(
        built if args.schedule in VIRTUAL else built[0], args.microbatches,
        loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD([p for layers in stages for p in layers.parameters()], lr=0.5)
    grad_table = GradTable(model, args.grad_table)  # other stages' weights: NaN, no gradient
    first, last = 0 in mine, num_stages - 1 in mine

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for step, (features, labels) in enumerate(train_loader):
            features, labels = features.to(env.device), labels.to(env.device)
            optimizer.zero_grad()
            losses = []
            schedule.step(*([features] if first else []), target=labels if last else None,
                          losses=losses if last else None)
            grad_table.record(epoch)
            optimizer.step()
            if epoch == step == 0:  # the order this rank ran (several stages: "sF0" is s's)
                if args.pp == "manual":  # minddp's stages keep a log of what they run
                    log = schedule.log if args.schedule in VIRTUAL else schedule.stage.log
                elif args.schedule not in VIRTUAL:  # one stage per rank: without its number
                    log = [action[len(str(mine[0])):] for action in log]
                print_rank(f"stage {', '.join(map(str, mine))}, {args.schedule}: {' '.join(log)}")
            if last:
                print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                           f" | Batchsize {labels.shape[0]:03d}"
                           f" | Train/Val Loss: {torch.stack(losses).mean():.4f}")  # the batch's
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file


def log_actions(stages, log):
    """Note each action stock's stages run, as minddp's log writes it: "sF0" is stage s's
    forward of microbatch 0; I and W a zero-bubble backward's halves, B both."""
    for stage in stages:
        def noted(run, kind, stage=stage):
            def call(chunk, *args, **kwargs):
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                log.append(f"{stage.stage_index}{kind if kind != 'B' or full else 'I'}{chunk}")
                return run(chunk, *args, **kwargs)
            return call
        stage.forward_one_chunk = noted(stage.forward_one_chunk, "F")
        stage.backward_one_chunk = noted(stage.backward_one_chunk, "B")
        stage.backward_weight_one_chunk = noted(stage.backward_weight_one_chunk, "W")

if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env}")  # world size, backend and device
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: teardown.py says why
