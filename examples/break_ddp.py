"""Break it and see: the lesson's job with one DDP ingredient removed, and the damage, measured.

    torchrun --nproc_per_node=2 examples/break_ddp.py --break average
    torchrun --nproc_per_node=2 examples/break_ddp.py --break all     # each break in turn
    torchrun --nproc_per_node=2 examples/break_ddp.py --break all --grad-table runs/b.txt

The DDP here is NaiveDDP's three moves written inline (broadcast, divide, all_reduce), each
behind a switch so that one can be left out; minddp's classes stay unbroken. After every
optimizer step minddp.check_replicas compares the ranks' weights bit for bit. The last
line of each break is its verdict. docs/break-it.md shows each output and says why. With
--break all, --grad-table PATH writes one table per break (runs/b-none.txt, runs/b-divide.txt...).
"""

from minddp import UsageError
from minddp.run.cli import lesson_parser, parse_checked
from minddp.run.errors import exit_on_usage_error

BREAKS = {
    "none": "everything in place",
    "broadcast": "no initial broadcast, and each rank seeded differently",
    "average": "gradients not all-reduced: each rank keeps its own",
    "divide": "gradients summed over ranks, not divided by the world size",
    "set_epoch": "sampler.set_epoch(epoch) never called",
    "shard": "no shard sampler: every rank iterates over the whole dataset",
}


def parse():
    parser = lesson_parser(__doc__)
    parser.add_argument("--break", dest="broken", default="all", metavar="NAME",
                        help="one of: all, " + ", ".join(BREAKS))
    args = parse_checked(parser)
    if args.broken not in ["all", *BREAKS]:
        with exit_on_usage_error():
            raise UsageError(f"unknown --break {args.broken!r}: choose one of all,"
                             f" {', '.join(BREAKS)}", same_on_every_rank=True,
                             hint="torchrun --nproc_per_node=2 examples/break_ddp.py --break none")
    return args


if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    args = parse()

import collections
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, ReplicaError, ShardSampler, broadcast_parameters,
                    check_replicas, ddp_setup, ddp_teardown, exit_on_failure, print0,
                    toy_datasets)



def train(env, args, broken):
    # The lesson seeds every rank alike, which draws the same first weights everywhere:
    # that alone would hide a missing broadcast. The broadcast break seeds per rank.
    torch.manual_seed(args.seed + (env.rank if broken == "broadcast" else 0))
    train_ds, _ = toy_datasets(args.factor)
    sampler = None if broken == "shard" else ShardSampler(train_ds)
    loader = DataLoader(train_ds, batch_size=2, shuffle=False, drop_last=True, sampler=sampler)
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if broken != "broadcast":
        broadcast_parameters(model)  # move 1: every rank starts from rank 0's weights
    grad_table = GradTable(model, table_path(args, broken))
    differ_at, factors, orders, step = replicas_differ(model, 0, None), [], [], 0
    for epoch in range(args.epochs):
        if sampler is not None and broken != "set_epoch":
            sampler.set_epoch(epoch)
        orders.append(list(sampler) if sampler is not None else list(range(len(train_ds))))
        for features, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(features), labels).backward()
            for p in model.parameters():
                own = p.grad.clone()
                if broken != "divide":
                    p.grad.div_(env.world_size)  # move 2: divide ...
                if broken != "average":
                    dist.all_reduce(p.grad)  # ... and sum: every rank now holds the mean
                if broken == "divide":  # measure against what DDP would have sent: the mean
                    mean = own / env.world_size
                    dist.all_reduce(mean)
                    factors.append((p.grad.norm() / mean.norm()).item())
            grad_table.record(epoch)
            optimizer.step()
            step += 1
            differ_at = replicas_differ(model, step, differ_at)
    grad_table.save()
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, orders)  # each rank's example order, per epoch
    return step, differ_at, factors, everyone


def table_path(args, broken):
    """--grad-table PATH; with --break all, one table per break: runs/t.txt -> runs/t-divide.txt."""
    if args.grad_table is None or args.broken != "all":
        return args.grad_table
    root, ext = os.path.splitext(args.grad_table)
    return f"{root}-{broken}{ext}"


def replicas_differ(model, step, differ_at):
    """(first step at which replicas differed, what differed), or None while they agree."""
    try:
        check_replicas(model)  # collective: bit for bit, every parameter and buffer
    except ReplicaError as err:
        return differ_at or (step, err.message.removeprefix("replicas differ: "))
    return differ_at


def verdict(env, broken, step, differ_at, factors, orders):
    if broken == "set_epoch":
        same = all(o == ranks[0] for ranks in orders for o in ranks)
        shown = "; ".join(f"rank {r} " + " ".join(map(str, ranks))
                          for r, ranks in enumerate(orders))
        return (f"{'same order' if same else 'a new order'} every epoch on every rank"
                f" ({len(orders[0])} epochs): {shown}")
    if broken == "shard":
        counts = collections.Counter(i for ranks in orders for i in ranks[0])
        return (f"duplicate: each of the {len(counts)} examples is seen {min(counts.values())}"
                f" times per epoch, once by every rank (world size {env.world_size})")
    if differ_at:
        at, message = differ_at
        start = "from the start" if at == 0 else f"from step {at} on"
        return f"replicas differ {start}: {message}"
    if broken == "divide":
        return (f"replicas identical, but every gradient is {sum(factors) / len(factors):.3f}x"
                f" stock DDP's (min {min(factors):.3f}x, max {max(factors):.3f}x) at world size"
                f" {env.world_size}: a sum where a mean was meant")
    return f"replicas identical after every step ({step} steps)"


def main(env, args):
    for broken in BREAKS if args.broken == "all" else [args.broken]:
        print0(f"--break {broken}: {BREAKS[broken]}")
        if broken == "broadcast":
            print0("  (the lesson seeds every rank alike, so the same first weights hide a missing"
                   " broadcast; here each rank is seeded differently)")
        result = train(env, args, broken)
        if broken in ("set_epoch", "shard"):
            replicas = "differ" if result[1] else "identical"
            print0(f"  replicas: {replicas}; the damage is in the data")
        print0(f"verdict: {broken}: {verdict(env, broken, *result)}")


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        env = ddp_setup("gloo", "cpu", args.timeout)
        if env.world_size < 2:
            raise UsageError("the break-it demo needs 2 or more processes: with one, nothing can"
                             " drift apart", same_on_every_rank=True,
                             hint="torchrun --nproc_per_node=2 examples/break_ddp.py"
                                  f" --break {args.broken}")
        main(env, args)
        ddp_teardown()
