"""Tensor parallelism: the manual DDP example with the last two layers split over the ranks.

    torchrun --nproc_per_node=2 examples/tp.py --grad-table runs/tp.txt
    torchrun --nproc_per_node=2 examples/tp.py --tp stock --grad-table runs/tp-stock.txt
    minddp diff runs/tp.txt runs/tp-stock.txt          # IDENTICAL

examples/manual_ddp.py with the wrapper replaced: layers.2 (30 -> 20) is split by columns of
its output, layers.4 (20 -> 2) by rows, so each rank holds half of each at 2 ranks and one
all_reduce per forward joins them (minddp/tp/parallel.py; docs/tp.md). Every rank trains on
the whole batch, the same one: the sampler deals every rank all of the data. Gradient tables hold
whole gradients, gathered from the slices.
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = parse_checked(lesson_parser(__doc__, tp=True)) if __name__ == "__main__" else None

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, all_reduce_accuracy, ddp_setup, ddp_teardown,
                    exit_on_failure, exit_on_usage_error, print0, print_rank, toy_datasets)
from minddp import ShardSampler
import minddp.tp as minddp_tp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import parallel as stock_tp


def main(env, args):
    torch.manual_seed(args.seed)  # the same seed on every rank: same data, same first weights
    train_ds, test_ds = toy_datasets(args.factor)
    train_loader = DataLoader(
        dataset=train_ds, batch_size=2, shuffle=False,  # the sampler shuffles, per epoch
        pin_memory=env.device.type == "cuda", drop_last=True,
        sampler=ShardSampler(train_ds, num_replicas=1, rank=0))  # every rank all of it
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    tp = minddp_tp if args.tp == "manual" else stock_tp
    mesh = init_device_mesh(env.device.type, (env.world_size,))  # the ranks that share layers
    plan = {"layers.2": tp.ColwiseParallel(),  # 30 -> 20: each rank its slice of the outputs
            "layers.4": tp.RowwiseParallel()}  # 20 -> 2: its slice of the inputs, then summed
    tp.parallelize_module(model, mesh, plan)  # rank 0's weights; each rank keeps its slices
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # after the split: over the slices
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
