"""Expert parallelism in one order: an expert's gradient a shard at a time, whatever ep.

    pytest tests/test_invariant.py -k experts           # ep and dp = 1, 2, 4: the same bits
    torchrun --nproc_per_node=2 examples/experts.py --invariant --grad-table runs/ep2.txt

Under expert parallelism (ep/parallel.py) an expert runs once on every row routed to it,
from every ep rank's tokens at once: its weight gradient is one matmul over rows from
several ranks' batches, summed in the kernel's order, and what "several" means is the mesh's
choice. The sum the replicated weights need (the embedding, attention, the router) is over
ranks as well. Here the global batch is cut into V virtual shards, rank r of W running its
run of V / W, one shard a step, every rank in step (the all_to_alls are collective). The
rows that arrive from ep rank j at step i are all of shard j's-run-start + i; each expert
runs each source's rows alone, with weights of their own for that shard (a fresh leaf
tensor, equal to the weight), so autograd hands back the expert's gradient shard by shard:
V leaves on the rank that holds the expert, folded in shard order by tree.py's tree (over
dp too, where dp ranks hold the same experts). In one process the same shards run one after
another through every expert: the same rows per expert and shard, the same leaves, the same
tree. The replicated weights' leaves are shards.py's, their tree over every rank.
Routing is per shard: the balancing loss, and a capacity (each expert keeps at most
ceil(factor x the shard's tokens x k / E) of the shard's pairs), depend on the shard alone,
so both are the same on every mesh; with a capacity that is another model than the normal
mode's, whose capacity counts a rank's tokens (docs/invariant.md).
  ShardExperts        in place of experts.py's Experts: this rank's experts, each source's
                      rows alone, a leaf per (weight, shard)
  ExpertShardTraining the step: V / W shards, a backward each; the sums; .grad set
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..ep.experts import Experts, MoE
from ..ep.parallel import all_to_all
from .shards import ShardGradients, shard_loss
from .tree import fold, tree_sum


class ShardExperts(nn.Module):
    """This rank's E / ep experts; every ep rank's rows of the current shard reach them."""

    def __init__(self, experts, group, shards_per_rank):
        super().__init__()
        self.group = group  # the ep ranks (None: one rank holds every expert)
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.per_rank, self.size = len(experts.mlps) // size, size
        first = rank * self.per_rank
        self.mlps = nn.ModuleDict({str(e): experts.mlps[str(e)]
                                   for e in range(first, first + self.per_rank)})
        self.here, self.step = shards_per_rank, 0  # shards a rank runs; which one now
        self.leaves = {p: {} for p in self.parameters()}  # weight -> {shard: its leaf}

    def forward(self, routed, counts):
        """routed: this shard's pairs sorted by expert, counts[e] for expert e. Collective
        over the ep ranks."""
        if self.group is not None:  # (1) the counts, (2) the rows: as ep/parallel.py
            rows = torch.empty_like(counts)
            dist.all_to_all_single(rows, counts, group=self.group)
            rows = rows.view(self.size, self.per_rank)
            send = counts.view(self.size, self.per_rank).sum(1).tolist()
            arrived = all_to_all(routed, send, rows.sum(1).tolist(), self.group)
        else:
            rows, arrived = counts.view(1, -1), routed
        # The rows come source by source, each source's sorted by expert: run each source's
        # rows of each expert alone, copied fresh (a view's offset can change a kernel's bits)
        outputs, at = [], 0
        for source in range(self.size):
            shard = source * self.here + self.step  # that rank's shard at this step
            for mlp, n in zip(self.mlps.values(), rows[source].tolist()):
                outputs.append(self._run(mlp, arrived[at:at + n].clone(), shard))
                at += n
        out = torch.cat(outputs)
        if self.group is None:
            return out
        return all_to_all(out, rows.sum(1).tolist(), send, self.group)

    def _run(self, mlp, x, shard):
        """The expert MLP on x with weights of this shard's own: up, GELU, down."""
        w = [self._leaf(p, shard) for p in (mlp.up.weight, mlp.up.bias, mlp.down.weight,
                                             mlp.down.bias)]
        return F.linear(F.gelu(F.linear(x, w[0], w[1])), w[2], w[3])

    def _leaf(self, p, shard):
        leaf = p.detach().clone().requires_grad_()  # its gradient: this shard's alone
        self.leaves[p][shard] = leaf
        return leaf

    @torch.no_grad()
    def reduce(self, dp_group, shards):
        """Each expert weight's .grad: its V / dp leaves folded in shard order, then the tree
        over the dp ranks that hold the same experts, / V. Collective over dp."""
        for p, leaves in self.leaves.items():
            grads = [leaves[s].grad if leaves[s].grad is not None
                     else torch.zeros_like(p) for s in sorted(leaves)]
            p.grad = tree_sum([fold(grads)], dp_group) / shards
            leaves.clear()


class ExpertShardTraining:
    """moe_gpt (bench/transformer.py) on a (dp, ep) mesh in shard order: the same bits on
    every mesh as in one process. Collective."""

    def __init__(self, model, mesh, *, shards=4, balance=0.01):
        torch.set_num_threads(1)  # a sum split over threads would add in their order
        group = {n: mesh.get_group(n) if mesh.size(n) > 1 else None
                 for n in mesh.mesh_dim_names}
        self.rank = mesh.get_local_rank("dp") * mesh.size("ep") + mesh.get_local_rank("ep")
        self.here = shards // mesh.size()  # this rank's run of shards
        self.model, self.shards, self.balance = model, shards, balance
        self.dp_group = group["dp"]
        self.world = [g for g in (group["ep"], group["dp"]) if g is not None]  # row by row
        self.experts = []
        for module in model.modules():
            if isinstance(module, MoE) and isinstance(module.experts, Experts):
                module.experts = ShardExperts(module.experts, group["ep"], self.here)
                self.experts.append(module.experts)
        skip = {p for e in self.experts for p in e.parameters()}
        self.grads = ShardGradients(model, self.world, shards, skip=skip)

    def step(self, x, y):
        """Every shard of this rank (x, y: the global batch), then the sums. Returns the
        step's loss; every weight's .grad is set."""
        rows = len(x) // self.shards
        losses = []
        for i in range(self.here):
            shard = self.rank * self.here + i
            xs, ys = (t[shard * rows:(shard + 1) * rows] for t in (x, y))
            for experts in self.experts:
                experts.step = i
            logits = self.model(xs)
            balance = sum(block.mlp.balance_loss for block in list(self.model)[1:-1])
            loss = F.cross_entropy(logits.flatten(0, 1), ys.flatten()) + self.balance * balance
            loss.backward()
            losses.append(loss.detach())
        self.grads.reduce()
        for experts in self.experts:
            experts.reduce(self.dp_group, self.shards)
        return shard_loss(losses, self.world, self.shards)
