"""Expert parallelism by hand: each rank holds some of the experts; tokens travel by all_to_all.

    torchrun --nproc_per_node=2 examples/experts.py --grad-table runs/ep.txt
    pytest tests/test_experts.py      # 2 and 4 ranks: bitwise one process on the whole batch

Every rank routes its own tokens (the router is replicated, experts.py), then each token
goes to the rank that holds its expert, and comes back. Rank j of W holds experts
j*E/W .. (j+1)*E/W - 1, so once the pairs are sorted by expert, those bound for rank j are
one contiguous run. In the order below:
  all_to_all      rows to ranks: send[j] rows to rank j, recv[j] from it. Its backward is
                  the same call the other way: each row's gradient goes back where it came from
  ExpertsOnRanks  stands in for experts.py's Experts, in five moves: (1) an all_to_all of
                  the counts, so each rank learns how many rows every rank sends to each of
                  its experts; (2) the rows (uneven splits); (3) the arrived rows regrouped by
                  expert, source order kept within; (4) each local expert on its rows; (5) back
                  to source order, and an all_to_all home
  expert_parallel puts ExpertsOnRanks in every MoE of a model, keeping this rank's experts
  sync_gradients  the replicated weights' gradients averaged over every rank; an expert's
                  summed over the ranks that hold it (dp), then divided by all W: the loss is
                  the mean of the W ranks' losses, and an expert's gradient already holds the
                  contributions of every rank's tokens (the all_to_all's backward brought them)
An expert sees its rows in the order (source rank, token). One process on the whole batch
(the ranks' batches one after the other, sorted stably by expert) gives each expert the
same rows in the same order, so its output and its gradient agree bit for bit.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from .experts import Experts, MoE
from ..launch.usage_error import UsageError


class _AllToAll(torch.autograd.Function):
    """Rows to ranks with uneven splits; the gradient of each row goes back the same way."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.how = send, recv, group
        arrived = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(arrived, rows.contiguous(), recv, send, group=group)
        return arrived

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.how
        back = grad.new_empty(sum(send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
        return back, None, None, None


def all_to_all(rows, send, recv, group=None):
    """Collective: send[j] of `rows` (in order) to rank j; the rows from every rank, in rank
    order (recv[j] from rank j). Differentiable."""
    return _AllToAll.apply(rows, send, recv, group)


class ExpertsOnRanks(nn.Module):
    """This rank's share of the experts, reached by every rank's tokens through all_to_all."""

    def __init__(self, experts, group=None):
        """Keep this rank's experts of `experts` (experts.py's Experts): E/W of them."""
        super().__init__()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        num_experts = len(experts.mlps)
        if num_experts % size:
            raise UsageError(f"{num_experts} experts do not split over {size} ranks",
                             hint="a number of experts that the ep ranks divide",
                             same_on_every_rank=True)
        self.group, self.num_experts, self.per_rank = group, num_experts, num_experts // size
        self.first = rank * self.per_rank  # this rank's first expert
        self.mlps = nn.ModuleDict({str(e): experts.mlps[str(e)]
                                   for e in range(self.first, self.first + self.per_rank)})

    def forward(self, routed, counts):
        """Collective. routed: this rank's pairs sorted by expert, counts[e] for expert e (E,);
        returns the experts' outputs for them, in the same order."""
        size = self.num_experts // self.per_rank
        # (1) rows[j][e]: how many rows rank j sends to my expert e (each rank's counts are
        # cut in W runs of per_rank, one run to each rank)
        rows = torch.empty_like(counts)
        dist.all_to_all_single(rows, counts, group=self.group)
        rows = rows.view(size, self.per_rank)
        send = counts.view(size, self.per_rank).sum(1).tolist()
        recv = rows.sum(1).tolist()
        arrived = all_to_all(routed, send, recv, self.group)  # (2) source-major
        # (3) expert-major: each row's expert, then a stable sort keeps source order within
        experts_of_rows = torch.arange(self.per_rank, device=rows.device).repeat(
            size).repeat_interleave(rows.flatten())
        by_expert = torch.argsort(experts_of_rows, stable=True)
        runs = arrived[by_expert].split(rows.sum(0).tolist())
        outputs = torch.cat([mlp(run) for mlp, run in zip(self.mlps.values(), runs)])  # (4)
        back = outputs[torch.argsort(by_expert)]  # (5) source-major again
        return all_to_all(back, recv, send, self.group)


def expert_parallel(model, mesh):
    """Each MoE of `model` keeps this rank's experts and reaches the others through the ep
    ranks (mesh["ep"], or a 1-D mesh). Collective: call on every rank."""
    group = mesh["ep"].get_group() if "ep" in mesh.mesh_dim_names else mesh.get_group()
    for module in model.modules():
        if isinstance(module, MoE) and isinstance(module.experts, Experts):
            module.experts = ExpertsOnRanks(module.experts, group)
    return model


@torch.no_grad()
def sync_gradients(model, mesh):
    """Average the gradients as one process on every rank's batch would. Collective.

    Replicated weights: all_reduce over every rank, / W. Experts: all_reduce over the ranks
    holding the same ones (mesh["dp"]; none with a 1-D mesh), / W as well.
    """
    world_size = mesh.size()
    dp = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
               for p in m.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in experts:
            dist.all_reduce(p.grad)  # the mesh is the world: every rank holds these
        elif dp is not None:
            dist.all_reduce(p.grad, group=dp)
        p.grad /= world_size  # the loss is the mean of all W ranks' losses
