"""Checkpoints and torchrun restarts: a rank dies mid-run, torchrun restarts, training resumes.

    torchrun --nproc_per_node=2 --max-restarts=1 examples/restart.py --checkpoint runs/ck.pt \
        --crash-at-step 3 --grad-table runs/restarted.txt          # add --ddp stock for stock's
    torchrun --nproc_per_node=2 examples/restart.py --checkpoint runs/whole.pt \
        --grad-table runs/whole.txt                                # the same run, not interrupted
    minddp diff runs/restarted.txt runs/whole.txt        # IDENTICAL, bit for bit
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = (parse_checked(lesson_parser(__doc__, timeline=True, restart=True))
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
from minddp import load_checkpoint, save_checkpoint
from minddp.run.faults import check_crash_step, crash_if_asked
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
    check_crash_step(args.crash_at_step, args.epochs * len(train_loader))

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = (BucketedDDP if args.ddp == "manual" else DDP)(model, device_ids=env.device_ids)
    grad_table = GradTable(model, args.grad_table)  # records nothing without --grad-table
    # Every rank reads the same file and copies it into the very tensors the wrapper and the
    # optimizer hold: all ranks resume equal, with no broadcast needed.
    start_epoch, step = load_checkpoint(args.checkpoint, env.device, args.epochs,
                                        model=model.module, optimizer=optimizer,
                                        grad_table=grad_table)
    timeline = record_timeline(model, optimizer, args.timeline)  # nothing without --timeline

    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for features, labels in train_loader:
            step += 1
            crash_if_asked(step, args.crash_at_step, args.crash_rank)  # fault injection
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
        # Collective (the table's rows are gathered); rank 0 writes, atomically.
        save_checkpoint(args.checkpoint, epoch, step, model=model.module, optimizer=optimizer,
                        grad_table=grad_table)

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
