"""Gradient accumulation: K micro-batches per optimizer step, one all-reduce per step.

    torchrun --nproc_per_node=2 examples/accumulate.py --ddp stock --grad-table runs/acc-stock.txt
    torchrun --nproc_per_node=2 examples/accumulate.py --grad-table runs/acc-manual.txt
    minddp diff runs/acc-manual.txt runs/acc-stock.txt         # IDENTICAL, bit for bit

The first K-1 forwards of a step run with model.require_backward_grad_sync = False (nanoGPT's
one line; `with model.no_sync():` around the forward sets the same flag): backward only adds.
Defaults: --accumulate 2 and --factor 4 (20 examples: 5 micro-batches per rank and epoch at
2 ranks, so steps of 2, 2 and 1 micro-batches).
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = (parse_checked(lesson_parser(__doc__, timeline=True, accumulate=True))
        if __name__ == "__main__" else None)  # the flags first, checked before torch loads

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, all_reduce_accuracy, check_batches, check_replicas,
                    ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0,
                    print_rank, toy_datasets)
from minddp.tools.timeline import record_timeline
from minddp import ShardSampler
from minddp import BucketedDDP
from torch.nn.parallel import DistributedDataParallel as DDP


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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = (BucketedDDP if args.ddp == "manual" else DDP)(model, device_ids=env.device_ids)
    grad_table = GradTable(model, args.grad_table)  # records nothing without --grad-table
    timeline = record_timeline(model, optimizer, args.timeline)  # nothing without --timeline

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for i, (features, labels) in enumerate(train_loader):
            features, labels = features.to(env.device), labels.to(env.device)
            first = i - i % args.accumulate  # this step's first micro-batch
            group = min(args.accumulate, len(train_loader) - first)  # the last may be short
            sync = i + 1 == first + group  # the group's last micro-batch: all-reduce, then step
            model.require_backward_grad_sync = sync  # read by forward: no_sync() without a block
            logits = model(features)
            loss = F.cross_entropy(logits, labels)
            # The sum of `group` of these is the gradient of the group's mean loss; dividing a
            # short last group by K instead would shrink its step (a smaller learning rate).
            (loss / group).backward()
            if not sync:
                continue  # no optimizer step yet: the next micro-batch adds to .grad
            grad_table.record(epoch)
            optimizer.step()
            optimizer.zero_grad()  # after the step, not before each backward: we accumulate
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
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file
    timeline.save()  # collective, the same way


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env}")  # world size, backend and device
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: teardown.py says why
