"""Data parallelism and microbatches in virtual shards: one order for the batch's sum, any mesh.

    pytest tests/test_invariant.py          # dp = 1, 2, 4 with pp = 1, 2: the same bits

A step's gradient is the mean over the global batch. DDP adds each rank's gradient of its
own samples (a sum over its rows inside a matmul, in the kernel's order), then all_reduces
over dp in gloo's ring order; a pipeline adds its microbatches' gradients one after another
into .grad and divides by their count; FSDP reduce_scatters. Each of these orders depends on
dp and pp. Here the global batch is cut into V virtual shards (V a power of two, the same
on every mesh). Each shard's gradient is computed alone, in one backward of its own (a
microbatch: dp rank r's microbatches are its run of V / dp shards, in order), taken out of
.grad as soon as autograd writes it (a post-accumulate-grad hook), and folded by tree.py's
tree: on the rank as the shards arrive, then over dp. Then divided by V once, exact for a
power of two. The loss is summed the same way.
  ShardGradients  hooks every weight (under fully_shard: the whole weight it computes with),
                  folds each shard's gradient; reduce() sums over dp and sets .grad (or the
                  shard's rows, under fully_shard), and returns the whole gradients
  ShardDropout    each shard's dropout mask drawn from (seed, step, shard, layer): the same
                  masks on every mesh
"""

import weakref

import torch

from ..fsdp.param import unit_of
from .tree import Folder, tree_sum


class ShardGradients:
    """Each weight's gradient, shard by shard, folded; reduce() sums over dp. Collective."""

    def __init__(self, stage, dp_group, shards, skip=()):
        """skip: weights whose shards' gradients are taken elsewhere (experts.py's)."""
        self.dp_group, self.shards = dp_group, shards
        self.folders = {}  # the tensor autograd writes -> its Folder
        self.targets = {}  # the same tensor -> (its name, the unit, its fully_shard Param)
        names = {id(p): n for n, p in stage.named_parameters()}
        for prefix, module in stage.named_modules():
            unit = unit_of(module)
            for p in unit.params if unit is not None else []:
                # fully_shard computes with p.full, the weight gathered whole over dp: its
                # gradient arrives whole there, before the unit would reduce_scatter it.
                self._hook(p.full, (f"{prefix}.{p.name}".lstrip("."), unit, p))
        hooked = {id(target[2].shard) for target in self.targets.values()}
        for name, p in stage.named_parameters():
            if id(p) not in hooked and p.requires_grad and p not in skip:
                self._hook(p, (names[id(p)], None, None))

    def _hook(self, tensor, target):
        self.folders[tensor] = Folder()
        self.targets[tensor] = target
        # A weak reference: the tensor holds its hook in C++, where the garbage collector
        # cannot see a cycle back to it, and a strong one would keep both (and the dp group).
        me = weakref.ref(self)
        tensor.register_post_accumulate_grad_hook(lambda t: me()._take(t))

    def _take(self, tensor):
        self.folders[tensor].add(tensor.grad)
        tensor.grad = None  # the next shard's gradient arrives alone, not added to this one

    @torch.no_grad()
    def reduce(self):
        """Collective over dp: every weight's gradient of the step, the mean over the V
        shards: set as .grad (fully_shard: this rank's rows). Returns {name: the whole
        gradient over dp} (this rank's tp slice, where tp splits it)."""
        whole = {}
        # Every weight's sum in one buffer, one tree over dp: each element is added on its
        # own, so the buffer changes no bit, only the number of collectives.
        mine = {tensor: folder.total() for tensor, folder in self.folders.items()}
        flat = tree_sum([torch.cat([g.reshape(-1) for g in mine.values()])], self.dp_group)
        flat = flat.div_(self.shards).split([g.numel() for g in mine.values()])
        for (tensor, g), piece in zip(mine.items(), flat):
            name, unit, p = self.targets[tensor]
            grad = piece.view_as(g)
            whole[name] = grad
            if unit is None:
                tensor.grad = grad
            else:  # this rank's block of rows, as fully_shard's reduce_scatter leaves it
                rows = grad[unit.rank * p.rows:(unit.rank + 1) * p.rows]
                p.shard.grad = unit.as_dtensor(rows.clone(), p.full)
        return whole


def shard_loss(losses, dp_group, shards):
    """Collective over dp: the step's loss, the mean of every shard's, in the tree's order."""
    return tree_sum(losses, dp_group) / shards


class ShardDropout:
    """Residual dropout whose masks depend on (seed, step, shard, block) alone: before each
    block runs, the generator is seeded with them; each mask is drawn whole for the shard's
    tokens, then cut to this rank's tokens under sequence parallel."""

    def __init__(self, p, seed, first_shard, tokens=(1, 0)):
        self.p, self.seed, self.first = p, seed, first_shard
        self.parts, self.part = tokens  # sequence parallel: (tp, this rank's place)
        self.step, self.shard = 0, first_shard

    def start(self, step):
        self.step, self.shard = step, self.first - 1

    def next_shard(self, module, args):
        self.shard += 1  # a stage's forwards come in microbatch order (GPipe, 1F1B)

    def seed_block(self, index):
        """A forward pre-hook for block `index` (its place in the whole model, on any
        stage). The global generator, not one of its own: a block under recomputation
        (memory/recompute.py) runs again in backward, later, with that generator's state
        put back, and draws the same masks; its own seed read then would be a later
        shard's."""
        def hook(module, args):
            if self.p:  # a number of its own for each: no hash(), salted in every process
                key = ((self.seed * 10**5 + self.step) * 10**4 + self.shard) * 10**3 + index
                torch.manual_seed(key % 2**63)
        return hook

    def drop(self, y, branch):
        """y with this block's next mask applied (the attention's, then the MLP's)."""
        if not self.p:
            return y
        whole = (y.shape[0], y.shape[1] * self.parts, *y.shape[2:])
        keep = torch.empty(whole).bernoulli_(1 - self.p)
        return y * (keep.chunk(self.parts, 1)[self.part] / (1 - self.p))
