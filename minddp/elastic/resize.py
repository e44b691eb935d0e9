"""Elastic training: lose ranks or gain them, go on from the last checkpoint, keep the numbers.

    torchrun --nnodes=1:2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --rdzv-id=job1 --max-restarts=3 examples/elastic.py --checkpoint-dir runs/elastic  # x2
    pytest tests/test_elastic.py               # 4 ranks resized to 1, 2, 3: the same weights

torchrun's elastic mode (--nnodes=MIN:MAX) re-forms the group when a node leaves or joins and
starts every worker again, now at another world size. Three things make the job go on right:
  checkpoint   saved as shards any world size can read: PyTorch's distributed checkpoint keeps
               each tensor's whole shape and where every saved block sits, so a rank at the new
               size reads exactly the rows it now owns (reshard_plan says which)
  global batch the step's samples do not depend on the world size: the batch is cut into
               virtual shards, and each rank takes a run of whole shards (ElasticBatchSampler)
  the sum      an all_reduce adds the ranks' gradients in an order set by the world size, so
               4 ranks and 3 ranks round differently (about 1e-8 after a few steps). Computing
               each virtual shard's gradient alone and adding them in shard order, whoever
               holds them (ordered_average), gives the same bits at every world size.
"""

import math

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError
from ..launch.groups import global_rank


def check_world(global_batch, world_size, virtual_shards=None):
    """One line when this world size cannot keep the global batch (or the shard count)."""
    if global_batch % world_size:
        raise UsageError(f"a global batch of {global_batch} cannot be kept at world size"
                         f" {world_size}: {global_batch} samples do not split evenly over"
                         f" {world_size} ranks", same_on_every_rank=True,
                         hint="pick a global batch every world size you may run at divides"
                              " (12 suits 1, 2, 3, 4 and 6 ranks)")
    if virtual_shards is not None and (virtual_shards % world_size
                                       or global_batch % virtual_shards):
        raise UsageError(f"{virtual_shards} virtual shards cannot be dealt to {world_size} ranks"
                         f" from a global batch of {global_batch}: each rank needs whole shards"
                         f" of whole samples", same_on_every_rank=True,
                         hint="a shard count that divides the global batch and that every"
                              " world size divides (12 shards for 1, 2, 3, 4 and 6 ranks)")


class ElasticBatchSampler(torch.utils.data.Sampler):
    """This rank's samples of each step; the step's global batch is the same at any world size.

    Epoch e's order is DistributedSampler's permutation (seed + e); step s takes its samples
    s*G .. (s+1)*G - 1 (the tail that fills no batch is dropped). Rank r of W takes the
    batch's r-th run of G/W samples: whole virtual shards, the same shards at any W.
    """

    def __init__(self, num_samples, global_batch, world_size, rank, seed=0):
        """Steps over `num_samples` examples, `global_batch` of them per step."""
        check_world(global_batch, world_size)
        self.n, self.global_batch, self.seed, self.epoch, self.start = \
            num_samples, global_batch, seed, 0, 0
        self.per_rank = global_batch // world_size
        self.first = rank * self.per_rank  # where this rank's run starts in every batch
        self.steps_per_epoch = num_samples // global_batch

    def set_epoch(self, epoch, start_step=0):
        """Start of each epoch; `start_step`: the steps a checkpoint has already taken."""
        self.epoch, self.start = epoch, start_step

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        for step in range(self.start, self.steps_per_epoch):
            batch = order[step * self.global_batch:(step + 1) * self.global_batch]
            yield batch[self.first:self.first + self.per_rank]

    def __len__(self):
        return self.steps_per_epoch - self.start


def shard_gradients(model, loss_fn, features, labels, shards_here):
    """Each of this rank's virtual shards' gradient computed alone: a [shards_here, P] tensor.

    Alone means the same forward and backward, on the same samples, at any world size: the
    per-shard gradient's bits then depend on the shard only. Returns the shards' losses too.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # One row per shard, each the shard's whole flat gradient.
    rows = params[0].new_empty(shards_here, sum(p.numel() for p in params))
    losses = []
    for row, x, y in zip(rows, features.chunk(shards_here), labels.chunk(shards_here)):
        # A copy, not the view: a view starts wherever the shard sits in this rank's batch, and
        # on some CPUs a matmul's bits depend on where its input starts in memory. A fresh
        # tensor starts aligned, so the shard's gradient is the same at every world size.
        x, y = x.clone(), y.clone()
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(loss, params)
        torch.cat([g.reshape(-1) for g in grads], out=row)  # flat, straight into its row
        losses.append(loss.detach())
    return rows, torch.stack(losses)


@torch.no_grad()
def ordered_average(mine, num_shards, group=None):
    """Collective: the mean of every virtual shard's gradient, added in shard order 0, 1, ...

    `mine` holds this rank's shards' rows, rank r holding shards r*k .. r*k + k - 1. The partial
    sum travels as a chain: rank r receives shards 0 .. r*k - 1 summed, adds its own rows one
    by one, passes it on; the last rank's total goes to everyone. ((g0 + g1) + g2) + ... is
    the one order at every world size. Each rank sends and receives one gradient and then
    the broadcast: the bytes of an all_reduce, but the ranks add one after another.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = None
    if rank > 0:
        total = mine.new_empty(mine.shape[1])
        dist.recv(total, src=global_rank(group, rank - 1), group=group)
    for row in mine:
        total = row.clone() if total is None else total.add_(row)
    if rank < world - 1:
        dist.send(total, dst=global_rank(group, rank + 1), group=group)
    if world > 1:
        dist.broadcast(total, src=global_rank(group, world - 1), group=group)
    return total.div_(num_shards)


def set_gradients(model, flat):
    """Hand each parameter its part of the flat gradient as .grad (the optimizer reads it)."""
    offset = 0
    for p in (p for p in model.parameters() if p.requires_grad):
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def shard_rows(rows, world_size, rank):
    """(start, stop) of the rows `rank` owns when torch.chunk cuts `rows` rows (FSDP's cut)."""
    per = math.ceil(rows / world_size)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def reshard_plan(rows, saved_world, world_size, rank):
    """What resharding on load reads: [(saved rank, its rows start..stop)] for `rank`'s rows.

    A checkpoint saved at `saved_world` holds each sharded tensor as saved_world blocks, each
    stamped with its offset in the whole. At the new size, rank owns rows start..stop and
    reads the overlap with every saved block: parts of one or two files, never the whole.
    """
    start, stop = shard_rows(rows, world_size, rank)
    plan = []
    for saved in range(saved_world):
        lo, hi = shard_rows(rows, saved_world, saved)
        if max(lo, start) < min(hi, stop):
            plan.append((saved, max(lo, start), min(hi, stop)))
    return plan
