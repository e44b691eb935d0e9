"""ShardedOptimizer: ZeRO stage 1 by hand, the optimizer state split over the ranks.

    torchrun --nproc_per_node=2 examples/zero1.py
    minddp zero-bench                 # optimizer-state bytes per rank, step times

With DDP every rank holds the whole optimizer state: for Adam two more tensors the size
of every parameter, more memory than the weights themselves. Yet after the all_reduce
every rank holds the same averaged gradient and would compute the same update. ZeRO-1
splits the work: each rank owns a shard of the parameters, keeps optimizer state for its
shard only and updates only its shard; then every rank receives each updated parameter
from its owner. The state exists once across the ranks instead of world_size times.

The cost is one more collective per step: every parameter travels once more, from its
owner to everyone. This file broadcasts each parameter from its owner, as PyTorch's
ZeroRedundancyOptimizer does by default. The alternative is one all_gather of a flat
buffer per step (fewer, larger messages). The next stage, ZeRO-2, also shards the
gradients: a reduce_scatter instead of DDP's all_reduce gives each rank just the averaged
gradient of its own shard, which is all its update needs. ZeRO-3 (FSDP) shards the
parameters themselves and gathers each layer just before it is used.

Its weights equal a plain optimizer's and ZeroRedundancyOptimizer's bit for bit
(tests/test_zero.py): the update of each parameter is the same arithmetic on the same
numbers, wherever it runs, and a broadcast copies bits.
"""

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError
from ..launch.groups import global_rank
from .state import consolidated, this_ranks_part


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: each rank keeps optimizer state for its shard of the parameters only.

    Collective: call on every rank. Construction and every step() communicate.
    """

    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        """Shard `params` over the ranks; this rank's shard gets optimizer_cls(its params)."""
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.optimizer_cls = optimizer_cls
        self._consolidated = None  # the full state, on the rank consolidate_state_dict() chose
        self.optim = None
        super().__init__(params, defaults)  # self.param_groups: every parameter, every rank
        _check_same_parameters(self.param_groups, process_group)
        # This rank's optimizer sees only this rank's shard: its state is the shard's.
        self.optim = optimizer_cls(self.partition[self.rank], **defaults)

    def _shards(self):
        """Per rank, its param groups: ZeroRedundancyOptimizer's sorted-greedy partition.

        Within each group, parameters largest first, each to the rank that holds the
        fewest elements so far (the lowest rank on a tie); a parameter is never split,
        so the shards are as even as whole parameters allow.
        """
        shards, sizes = [[] for _ in range(self.world_size)], [0] * self.world_size
        for group in self.param_groups:
            mine = [[] for _ in range(self.world_size)]
            for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                rank = sizes.index(min(sizes))
                mine[rank].append(p)
                sizes[rank] += p.numel()
            for rank in range(self.world_size):
                shards[rank].append({**group, "params": mine[rank]})
        return shards

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._sharded = {p for g in self.param_groups for p in g["params"]}
        self.partition = self._shards()  # per rank, its param groups; once per group added
        if self.optim is not None:  # after construction: the new group's shard, here
            self.optim.add_param_group(self.partition[self.rank][-1])

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard, then receive every other shard from its owner."""
        stray = [i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
                 if p not in self._sharded]
        if stray:
            # Every rank sees the same groups, so every rank stops here alike: none is left
            # waiting in a broadcast.
            raise UsageError(f"parameter #{stray[0]} of the optimizer's groups is in no shard: it"
                             f" joined the groups after the optimizer was built",
                             hint="add parameters with add_param_group(), which gives them a shard",
                             same_on_every_rank=True)
        shards = self.partition
        for mine, local in zip(self.param_groups, self.optim.param_groups):
            # Hyperparameters live in our groups (an LR scheduler writes them there).
            local.update({k: v for k, v in mine.items() if k != "params"})
        loss = self.optim.step(closure)
        works = []
        for owner in range(self.world_size):
            src = global_rank(self.process_group, owner)  # src= takes a global rank
            for group in shards[owner]:
                for p in group["params"]:
                    works.append(dist.broadcast(p.data, src=src, group=self.process_group,
                                                async_op=True))
        for work in works:
            work.wait()  # every weight is current before the next forward
        return loss

    def consolidate_state_dict(self, to=0):
        """Collective: call on every rank. Gathers the full optimizer state on rank `to`."""
        self._consolidated = consolidated(self, to)  # (state.py: the plumbing)

    def state_dict(self):
        """The full state as a plain optimizer's; call consolidate_state_dict() first."""
        if self._consolidated is None:
            raise UsageError(f"rank {self.rank} holds only its shard of the optimizer state",
                             hint="call optimizer.consolidate_state_dict(to=RANK) on every rank"
                                  " first, then state_dict() on RANK")
        return self._consolidated

    def load_state_dict(self, state_dict):
        """Load a full state (this class's or a plain optimizer's); each rank keeps its part."""
        self.optim.load_state_dict(this_ranks_part(self, state_dict))
        self._consolidated = None


def _check_same_parameters(param_groups, group):
    """Every rank must shard the same list of parameters, or the broadcasts pair up wrong."""
    if dist.get_world_size(group) == 1:
        return
    mine = [[tuple(p.shape) for p in g["params"]] for g in param_groups]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise UsageError(f"rank {rank}'s optimizer parameters differ from rank 0's (shapes"
                             f" {theirs} vs {everyone[0]})", same_on_every_rank=True,
                             hint="build the same model on every rank and pass its parameters"
                                  " the same way")
