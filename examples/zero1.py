"""ZeRO-1: the manual DDP example with AdamW's state sharded over the ranks.

    torchrun --nproc_per_node=2 examples/zero1.py --grad-table runs/zero1.txt
    torchrun --nproc_per_node=2 examples/zero1.py --zero stock --grad-table runs/zero1-stock.txt
    minddp diff runs/zero1.txt runs/zero1-stock.txt      # IDENTICAL

examples/manual_ddp.py with the optimizer changed: AdamW (two state tensors per parameter),
sharded. Each rank keeps the state for its shard of the parameters only, updates that shard,
and receives the rest from their owners (minddp/zero/optimizer.py; docs/zero1.md); after training
each rank prints which parameters' state it holds and how many bytes. `--zero stock` shards
with PyTorch's ZeroRedundancyOptimizer instead.
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = parse_checked(lesson_parser(__doc__, zero=True)) if __name__ == "__main__" else None

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, all_reduce_accuracy, check_batches, check_replicas,
                    ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0,
                    print_rank, toy_datasets)
from minddp import ShardSampler
from minddp import BucketedDDP
from minddp import ShardedOptimizer
from torch.distributed.optim import ZeroRedundancyOptimizer


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
    sharded = ShardedOptimizer if args.zero == "manual" else ZeroRedundancyOptimizer
    optimizer = sharded(model.parameters(), torch.optim.AdamW, lr=0.05)  # ZeRO-1
    model = BucketedDDP(model, device_ids=env.device_ids)  # rank 0's weights; buckets average
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
            if args.check_replicas:
                check_replicas(model)  # collective: every rank holds the same weights, bit for bit
            print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                       f" | Batchsize {labels.shape[0]:03d}"
                       f" | Train/Val Loss: {loss:.4f}")  # this rank's own loss

    model.eval()
    train_acc = all_reduce_accuracy(model, train_loader, env.device)  # collective: every rank
    test_acc = all_reduce_accuracy(model, test_loader, env.device)
    print0(f"Training accuracy {train_acc}")
    print0(f"Test accuracy {test_acc}")
    state = optimizer.optim.state  # this rank's inner AdamW: the state of its shard only
    names = [n for n, p in model.module.named_parameters() if p in state]
    kib = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()) / 1024
    print_rank(f"AdamW state for {len(names)} of {len(list(model.parameters()))} parameters"
               f" ({', '.join(names)}): {kib:.2f} KiB")
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env}")  # world size, backend and device
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: teardown.py says why
