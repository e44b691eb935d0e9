"""FSDP: the manual DDP example with each layer's weights sharded over the ranks.

    torchrun --nproc_per_node=2 examples/fsdp.py --grad-table runs/fsdp.txt
    torchrun --nproc_per_node=2 examples/fsdp.py --fsdp stock --grad-table runs/fsdp-stock.txt
    minddp diff runs/fsdp.txt runs/fsdp-stock.txt     # IDENTICAL
    torchrun --nproc_per_node=2 examples/stock_ddp.py --grad-table runs/stock.txt
    minddp diff runs/fsdp.txt runs/stock.txt          # IDENTICAL at 1 and 2 ranks

examples/manual_ddp.py with the wrapper replaced: each Linear layer is a unit whose weights
are gathered just before it runs and freed after (minddp/fsdp/shard.py; docs/fsdp.md). The
optimizer is built after sharding, over the shards. Gradient tables hold whole gradients.
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = parse_checked(lesson_parser(__doc__, fsdp=True)) if __name__ == "__main__" else None

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, all_reduce_accuracy, check_batches,
                    ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0,
                    print_rank, toy_datasets)
from minddp import ShardSampler
from minddp.fsdp.shard import fully_shard
from torch.distributed.fsdp import fully_shard as stock_fully_shard


def main(env, args):
    torch.manual_seed(args.seed)  # the same seed on every rank: same data, same first weights
    train_ds, test_ds = toy_datasets(args.factor)
    train_loader = DataLoader(
        dataset=train_ds, batch_size=2, shuffle=False,  # the sampler shuffles, per epoch
        pin_memory=env.device.type == "cuda", drop_last=True,
        sampler=ShardSampler(train_ds))  # this rank's shard of every epoch
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)
    check_batches(train_loader, env.world_size)  # zero batches on a rank: one line, exit 2

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    shard = fully_shard if args.fsdp == "manual" else stock_fully_shard
    for layer in model.layers[::2]:  # the three Linear layers: one unit each
        shard(layer)  # gathered just before the layer runs, freed after
    shard(model)  # the root: runs the end of backward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # after sharding: over the shards
    grad_table = GradTable(model, args.grad_table)  # records nothing without --grad-table

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for features, labels in train_loader:
            features, labels = features.to(env.device), labels.to(env.device)
            logits = model(features)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()  # when it returns, every .grad is the average over ranks
            grad_table.record(epoch)
            optimizer.step()
            print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                       f" | Batchsize {labels.shape[0]:03d}"
                       f" | Train/Val Loss: {loss:.4f}")  # this rank's own loss

    model.eval()
    train_acc = all_reduce_accuracy(model, train_loader, env.device)  # collective: every rank
    test_acc = all_reduce_accuracy(model, test_loader, env.device)
    print0(f"Training accuracy {train_acc}")
    print0(f"Test accuracy {test_acc}")
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env}")  # world size, backend and device
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: teardown.py says why
