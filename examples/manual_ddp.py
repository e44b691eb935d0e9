"""Lesson 9.3's DDP script with minddp's hand-built DDP in place of stock PyTorch's.

    torchrun --nproc_per_node=2 examples/manual_ddp.py
    torchrun --nproc_per_node=2 examples/manual_ddp.py --grad-table manual.txt
    python examples/manual_ddp.py                      # world size 1, no torchrun
    torchrun --nproc_per_node=2 examples/manual_ddp.py --factor 4 --accumulate 2
    torchrun --nproc_per_node=2 --max-restarts=1 examples/manual_ddp.py \\
        --checkpoint ck.pt --crash-at-step 3          # a rank dies; torchrun restarts; resume

examples/stock_ddp.py is this file with stock DDP's pieces; only they differ:
`diff examples/stock_ddp.py examples/manual_ddp.py` is the lesson.
"""

import argparse
import contextlib
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, check_batches, check_crash_step, compute_accuracy,
                    crash_if_asked, ddp_setup, ddp_teardown, exit_on_usage_error,
                    load_checkpoint, print0, print_rank, save_checkpoint, toy_datasets)
from minddp import ShardSampler
from minddp import ManualDDP


def main(args):
    env = ddp_setup(args.backend, args.device, args.timeout)  # rank, local_rank, world_size, ...
    print0(f"PyTorch {torch.__version__} | world size {env.world_size} | backend {env.backend}"
           f" | device {env.device} | CUDA GPUs {torch.cuda.device_count()}")

    torch.manual_seed(args.seed)  # same seed on every rank: same data noise, same first weights
    train_ds, test_ds = toy_datasets(args.factor)
    train_loader = DataLoader(
        dataset=train_ds, batch_size=2, shuffle=False,  # the sampler shuffles, per epoch
        pin_memory=env.device.type == "cuda", drop_last=True,
        sampler=ShardSampler(train_ds))  # this rank's shard of every epoch
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)
    check_batches(train_loader, env.world_size)
    steps_per_epoch = math.ceil(len(train_loader) / args.accumulate)  # optimizer steps
    check_crash_step(args.crash_at_step, args.epochs * steps_per_epoch)

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grad_table = GradTable(model, args.grad_table)  # records nothing without --grad-table
    # Resume before wrapping: every rank loads the same file, so all start equal anyway.
    start_epoch, step = load_checkpoint(args.checkpoint, model, optimizer, grad_table, env.device)
    model = ManualDDP(model)  # broadcasts rank 0's weights; hooks average the gradients

    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for i, (features, labels) in enumerate(train_loader):
            crash_if_asked(step + 1, args.crash_at_step, args.crash_rank)  # --crash-at-step
            features, labels = features.to(env.device), labels.to(env.device)
            # --accumulate K: K micro-batches per optimizer step. Only the K-th backward
            # all-reduces; under no_sync() the others just add into .grad, locally.
            sync = (i + 1) % args.accumulate == 0 or i + 1 == len(train_loader)
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = model(features)
                loss = F.cross_entropy(logits, labels)
                # Summed gradients of loss/K are the gradient of the mean over K micro-batches.
                (loss / args.accumulate).backward()  # synced: every .grad is the average over ranks
            print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                       f" | Batchsize {labels.shape[0]:03d}"
                       f" | Train/Val Loss: {loss:.4f}")  # this rank's own loss, not the average
            if sync:
                grad_table.record(epoch)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
        save_checkpoint(args.checkpoint, model, optimizer, epoch, step, grad_table)

    model.eval()
    train_acc = compute_accuracy(model, train_loader, device=env.device)
    test_acc = compute_accuracy(model, test_loader, device=env.device)
    print0(f"Training accuracy {train_acc}")
    print0(f"Test accuracy {test_acc}")
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file
    ddp_teardown()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--seed", type=int, default=123, help="torch.manual_seed before data and model")
    parser.add_argument("--factor", type=int, default=1,
                        help="enlarge the 5-example training set this many times (the lesson's factor)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                        help="micro-batches per optimizer step (gradient accumulation)")
    parser.add_argument("--grad-table", metavar="PATH", help="record every synced gradient to PATH")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save after every epoch; if PATH exists at start, resume from it")
    parser.add_argument("--crash-at-step", type=int, metavar="K",
                        help="fault injection: one rank exits abruptly as step K (from 1) begins,"
                             " on the first attempt only")
    parser.add_argument("--crash-rank", type=int, metavar="R", help="the rank that crashes (default: the last)")
    parser.add_argument("--timeout", type=float, default=120, metavar="S",
                        help="seconds a rank waits in a collective for its peers before failing")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="auto: nccl with one GPU per process, else gloo")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto: cuda:LOCAL_RANK with nccl, mps for one process on a Mac, else cpu")
    args = parser.parse_args()
    if args.accumulate < 1:
        parser.error("--accumulate must be 1 or more")
    return args


if __name__ == "__main__":
    with exit_on_usage_error():  # a setup mistake: one line and a hint, exit status 2
        main(parse_args())
