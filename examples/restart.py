"""Checkpoints and torchrun restarts: a rank dies mid-run, torchrun restarts, training resumes.

    torchrun --nproc_per_node=2 --max-restarts=1 examples/restart.py \\
        --checkpoint runs/ck.pt --crash-at-step 3 --grad-table runs/restarted.txt
    torchrun --nproc_per_node=2 examples/restart.py --checkpoint runs/whole.pt \\
        --grad-table runs/whole.txt                     # the same run, never interrupted
    python -m minddp.diff runs/restarted.txt runs/whole.txt   # IDENTICAL

examples/manual_ddp.py plus three things: resume from --checkpoint if the file exists,
save it after every epoch, and (--crash-at-step K) one rank dies as step K begins.
"""

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, all_reduce_accuracy, check_batches, check_replicas,
                    ddp_setup, ddp_teardown, exit_on_usage_error, load_checkpoint, print0,
                    print_rank, save_checkpoint, toy_datasets)
from minddp.cli import add_ddp_flag, ddp_pieces, lesson_parser, parse_checked
from minddp.faults import check_crash_step, crash_if_asked


def main(env, args):
    Sampler, wrap = ddp_pieces(args.ddp)  # ShardSampler, ManualDDP (or stock's with --ddp stock)
    torch.manual_seed(args.seed)
    train_ds, test_ds = toy_datasets(args.factor)
    train_loader = DataLoader(dataset=train_ds, batch_size=2, shuffle=False,
                              pin_memory=env.device.type == "cuda", drop_last=True,
                              sampler=Sampler(train_ds))
    test_loader = DataLoader(dataset=test_ds, batch_size=2, shuffle=False)
    check_batches(train_loader, env.world_size)
    check_crash_step(args.crash_at_step, args.epochs * len(train_loader))

    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grad_table = GradTable(model, args.grad_table)
    # Resume before wrapping: every rank loads the same file, so all start equal anyway.
    start_epoch, step = load_checkpoint(args.checkpoint, env.device, model=model,
                                        optimizer=optimizer, grad_table=grad_table)
    if start_epoch >= args.epochs:
        print0(f"{args.checkpoint} holds a finished run ({start_epoch} epochs): nothing left to"
               f" train; delete it to start afresh, or ask for more --epochs")
    model = wrap(model, env)

    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for features, labels in train_loader:
            step += 1
            crash_if_asked(step, args.crash_at_step, args.crash_rank)  # fault injection
            features, labels = features.to(env.device), labels.to(env.device)
            loss = F.cross_entropy(model(features), labels)
            optimizer.zero_grad()
            loss.backward()
            grad_table.record(epoch)
            optimizer.step()
            if args.check_replicas:
                check_replicas(model)  # collective: the same weights everywhere
            print_rank(f"Epoch: {epoch + 1:03d}/{args.epochs:03d}"
                       f" | Batchsize {labels.shape[0]:03d}"
                       f" | Train/Val Loss: {loss:.4f}")
        # Collective (the table's rows are gathered); rank 0 writes, atomically.
        save_checkpoint(args.checkpoint, epoch, step, model=model.module, optimizer=optimizer,
                        grad_table=grad_table)

    model.eval()
    print0(f"Training accuracy {all_reduce_accuracy(model, train_loader, env.device)}")
    print0(f"Test accuracy {all_reduce_accuracy(model, test_loader, env.device)}")
    grad_table.save()


if __name__ == "__main__":
    with exit_on_usage_error():
        parser = lesson_parser(__doc__)
        add_ddp_flag(parser)
        parser.add_argument("--checkpoint", metavar="PATH", required=True,
                            help="save after every epoch; if PATH exists at start, resume from it")
        parser.add_argument("--crash-at-step", type=int, metavar="K",
                            help="one rank exits abruptly as step K (from 1) begins,"
                                 " first attempt only")
        parser.add_argument("--crash-rank", type=int, metavar="R",
                            help="the rank that crashes (default: the last)")
        args = parse_checked(parser)
        env = ddp_setup(args.backend, args.device, args.timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # 0, then 1 after a restart
        print0(f"world size {env.world_size} | torchrun attempt {attempt}")
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: launch.py says why
