"""Elastic training: a node leaves, the job goes on at fewer ranks; it comes back, at more.

    # two "nodes" on one machine: this command in two terminals (the first one started hosts
    # the rendezvous: stop the other); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with torch 2.13
    torchrun --nnodes=1:2 --nproc_per_node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=job1 --max-restarts=3 \\
        --rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=30 \\
        examples/elastic.py --checkpoint-dir runs/elastic --grad-table runs/elastic.txt \\
        --step-delay 1
    # Ctrl-C in the second: the first's workers fail, restart at world size 2 and resume from
    # the last checkpoint; start the second again: both restart at 4 (docs/elastic.md)

    torchrun --nproc_per_node=4 examples/elastic.py --checkpoint-dir runs/whole \\
        --grad-table runs/whole.txt                         # the run never resized
    minddp diff runs/elastic.txt runs/whole.txt             # --reduce ordered: IDENTICAL

The global batch (--global-batch, 12) is the same at every world size: each rank takes
12 / world_size samples per step, a run of whole virtual shards (minddp/elastic/resize.py).
"""

from minddp.run.cli import lesson_parser, parse_checked  # no torch: a typo costs a moment

args = (parse_checked(lesson_parser(__doc__, elastic=True))
        if __name__ == "__main__" else None)  # the flags first, checked before torch loads

import hashlib
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from minddp import (GradTable, NeuralNetwork, UsageError, broadcast_parameters, ddp_setup,
                    ddp_teardown, exit_on_failure, exit_on_usage_error, print0, print_rank,
                    toy_datasets)
from minddp import BucketedDDP
from minddp.elastic.resize import (ElasticBatchSampler, check_world, ordered_average, set_gradients,
                            shard_gradients)
from minddp.run.faults import hold_before
from minddp.run.sharded_checkpoint import load_sharded, save_sharded
from torch.nn.parallel import DistributedDataParallel as DDP


def main(env, args):
    torch.manual_seed(args.seed)  # the same seed on every rank: same data, same first weights
    train_ds, _ = toy_datasets(args.factor)
    ordered = args.reduce == "ordered"
    shards = args.virtual_shards // env.world_size  # this rank's virtual shards (ordered)
    check_world(args.global_batch, env.world_size, args.virtual_shards if ordered else None)
    sampler = ElasticBatchSampler(len(train_ds), args.global_batch, env.world_size, env.rank,
                                  seed=args.seed)  # this rank's run of every global batch
    train_loader = DataLoader(train_ds, batch_sampler=sampler)
    model = NeuralNetwork(num_inputs=2, num_outputs=2).to(env.device)
    if ordered:
        broadcast_parameters(model)  # no DDP wrapper: ordered_average below is the sync
    else:
        model = (BucketedDDP if args.reduce == "plain" else DDP)(model, device_ids=env.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    grad_table = GradTable(model, args.grad_table, rank0_only=True)  # rows across resizes

    # Whatever world size wrote the newest checkpoint, each rank loads its part of it.
    saved = load_sharded(args.checkpoint_dir, model, optimizer)
    step = 0
    if saved is not None:
        check_same_run(saved, args)
        step = saved["step"]
        grad_table.load_state_dict(saved["table"])
        print0(f"resuming after step {step}: saved at world size {saved['world_size']},"
               f" now {env.world_size}"
               f" (torchrun attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")
    print_rank(f"world size {env.world_size}: takes samples {sampler.first}.."
               f"{sampler.first + sampler.per_rank - 1} of each global batch of"
               f" {args.global_batch}" + (f", virtual shards {env.rank * shards}.."
               f"{(env.rank + 1) * shards - 1}" if ordered else ""))

    for epoch in range(step // sampler.steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch, start_step=step - epoch * sampler.steps_per_epoch)
        for features, labels in train_loader:
            step += 1
            hold_before(step, args.hold_file)  # (a test's gate; no --hold-file: no wait)
            features, labels = features.to(env.device), labels.to(env.device)
            optimizer.zero_grad()
            if ordered:  # each shard's gradient alone, then all of them added in shard order
                rows, losses = shard_gradients(model, F.cross_entropy, features, labels, shards)
                set_gradients(model, ordered_average(rows, args.virtual_shards))
                loss = losses.mean()
            else:
                loss = F.cross_entropy(model(features), labels)
                loss.backward()  # the wrapper averages over the ranks: 12 / W samples each
            grad_table.record(epoch)
            optimizer.step()
            print_rank(f"step {step:03d} | world size {env.world_size}"
                       f" | Batchsize {labels.shape[0]:03d} | Train Loss: {loss:.4f}")
            save_sharded(args.checkpoint_dir, step, model, optimizer, extra={
                "world_size": env.world_size, "global_batch": args.global_batch,
                "reduce": args.reduce, "table": grad_table.state_dict()})
            time.sleep(args.step_delay)

    weights = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    print0(f"final weights after step {step}: sha1 {hashlib.sha1(weights.numpy()).hexdigest()}")
    grad_table.save()  # rank 0 writes the table: one row per step, with its world size


def check_same_run(saved, args):
    """A checkpoint of another global batch or reduction would not continue this run."""
    for name in ("global_batch", "reduce"):
        if saved[name] != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"the checkpoint in {args.checkpoint_dir} was written with"
                             f" {flag} {saved[name]}, this run has {getattr(args, name)}",
                             hint=f"resume with {flag} {saved[name]}, or another"
                                  f" --checkpoint-dir", same_on_every_rank=True)


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env}")  # world size, backend and device
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: teardown.py says why
