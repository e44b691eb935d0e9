"""Gradient accumulation with no_sync(): K micro-batches per optimizer step, one all-reduce.

    torchrun --nproc_per_node=2 examples/accumulate.py --factor 4 --accumulate 2
    torchrun --nproc_per_node=2 examples/accumulate.py --factor 4 --accumulate 2 \\
        --ddp stock --grad-table runs/acc-stock.txt

examples/manual_ddp.py with the inner loop changed: the first K-1 backwards of each
optimizer step run under no_sync() and only add into .grad; the K-th all-reduces the sum.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, all_reduce_accuracy, check_batches, check_replicas,
                    ddp_setup, ddp_teardown, exit_on_usage_error, print0, print_rank, toy_datasets)
from minddp.cli import add_ddp_flag, ddp_pieces, lesson_parser, parse_checked


def main(env, args):
    Sampler, wrap = ddp_pieces(args.ddp)  # ShardSampler, ManualDDP (or stock's with --ddp stock)
    torch.manual_seed(args.seed)
    train_ds, test_ds = toy_datasets(args.factor)
    train_loader = DataLoader(dataset=train_ds, batch_size=2, shuffle=False,
                              pin_memory=env.device.type == "cuda", drop_last=True,
                              sampler=Sampler(train_ds))
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)
    check_batches(train_loader, env.world_size)

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = wrap(model, env)
    grad_table = GradTable(model, args.grad_table)

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for i, (features, labels) in enumerate(train_loader):
            features, labels = features.to(env.device), labels.to(env.device)
            # Only the K-th micro-batch (or the epoch's last) all-reduces; under
            # no_sync() the others' backwards just add into .grad, locally.
            sync = (i + 1) % args.accumulate == 0 or i + 1 == len(train_loader)
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(features), labels)
                # Summed gradients of loss/K are the gradient of the mean over K micro-batches.
                (loss / args.accumulate).backward()
            print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                       f" | Batchsize {labels.shape[0]:03d}"
                       f" | Train/Val Loss: {loss:.4f}")
            if sync:
                grad_table.record(epoch)
                optimizer.step()
                if args.check_replicas:
                    check_replicas(model)  # collective: the same weights everywhere
                optimizer.zero_grad()  # after the step, not before each backward: we accumulate

    model.eval()
    print0(f"Training accuracy {all_reduce_accuracy(model, train_loader, env.device)}")
    print0(f"Test accuracy {all_reduce_accuracy(model, test_loader, env.device)}")
    grad_table.save()


if __name__ == "__main__":
    with exit_on_usage_error():
        parser = lesson_parser(__doc__)
        add_ddp_flag(parser)
        parser.add_argument("--accumulate", type=int, default=2, metavar="K",
                            help="micro-batches per optimizer step")
        args = parse_checked(parser)
        env = ddp_setup(args.backend, args.device, args.timeout)
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: launch.py says why
