"""Lesson 9.3's DDP script with minddp's hand-built DDP in place of stock PyTorch's.

    torchrun --nproc_per_node=2 examples/manual_ddp.py
    torchrun --nproc_per_node=2 examples/manual_ddp.py --grad-table manual.txt
    python examples/manual_ddp.py                      # world size 1, no torchrun

examples/stock_ddp.py is this file with stock DDP's pieces; only they differ:
`diff examples/stock_ddp.py examples/manual_ddp.py` is the lesson.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, check_batches, compute_accuracy, ddp_setup,
                    ddp_teardown, exit_on_usage_error, print0, print_rank, toy_datasets)
from minddp import ShardSampler
from minddp import ManualDDP


def main(args):
    env = ddp_setup(args.backend, args.device)  # rank, local_rank, world_size, backend, device
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

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = ManualDDP(model)  # broadcasts rank 0's weights; hooks average each gradient
    grad_table = GradTable(model, args.grad_table)  # records nothing without --grad-table

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for features, labels in train_loader:
            features, labels = features.to(env.device), labels.to(env.device)
            logits = model(features)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()  # when this returns, every .grad is the average over ranks
            grad_table.record(epoch)
            optimizer.step()
            print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                       f" | Batchsize {labels.shape[0]:03d}"
                       f" | Train/Val Loss: {loss:.4f}")  # this rank's own loss, not the average

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
    parser.add_argument("--grad-table", metavar="PATH", help="record every synced gradient to PATH")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="auto: nccl with one GPU per process, else gloo")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto: cuda:LOCAL_RANK with nccl, mps for one process on a Mac, else cpu")
    return parser.parse_args()


if __name__ == "__main__":
    with exit_on_usage_error():  # a setup mistake: one line and a hint, exit status 2
        main(parse_args())
