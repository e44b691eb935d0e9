"""HSDP: fully_shard on a 2-D mesh, sharded within each row, replicated down the columns.

    pytest tests/test_fsdp.py -k hsdp     # 2 x 2, 1 x 4, 4 x 1: each rank's bits stock's

FSDP over every rank all-gathers each unit over all of them, twice a step. On many nodes
that is the slow link: HSDP (hybrid sharding) shards each weight only within a group of
ranks (a node), and keeps whole copies of those shards on the other groups. Stock's
fully_shard does it when given a 2-D mesh, whose dimension 0 replicates and dimension 1
shards (torchtitan names them dp_replicate and dp_shard). For mesh_shape (2, 2):

        dp_shard ->         rank 0 holds rows 0-3 of a weight of 7, rank 1 rows 4-6;
    dp_replicate [[0, 1],   ranks 2 and 3 hold the same rows as 0 and 1: replicas.
          v       [2, 3]]   The all_gather runs within a row, [0, 1] or [2, 3].

Each unit is the lesson's (fsdp/shard.py) with its group the shard group; Hybrid below adds
the replicate dimension, and dropin/fsdp.py's HybridUnit puts the drop-in's features on top:
  shard           rank (0, 0)'s weights: broadcast down the column, then along the row
  as_dtensor      each block a DTensor on the 2-D mesh, placements (Replicate(), Shard(0)),
                  as stock's: full_tensor(), clip_grad_norm_ and checkpoints see the whole
  reduce_scatter  stock's foreach_reduce: reduce_scatter over the shard group, then one
                  all_reduce over the replicate group of what it left, both in reduce_dtype
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh as StockMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..ddp.broadcast import check_same_model
from ..fsdp import shard as fsdp
from ..launch.groups import global_rank


def divide_factors(dtype, data_parallel_size):
    """Stock's _get_gradient_divide_factors: (divide before, divide after, the ReduceOp)."""
    if data_parallel_size == 1:
        return None, None, dist.ReduceOp.SUM
    if dtype in (torch.float32, torch.bfloat16):  # no overflow to fear: the collective divides
        return None, None, dist.ReduceOp.AVG  # (gloo sums, then divides)
    # float16 (and float64, by stock's test) sum: divide by a power of two near sqrt(size)
    # before the sum, by the rest after, so that neither the parts nor the sum overflow.
    factor = float(data_parallel_size)
    before = 1
    while factor % before == 0 and factor / before > before:
        before *= 2
    return before, factor / before, dist.ReduceOp.SUM


def stock_mesh(mesh):
    """The 2-D mesh as stock's DeviceMesh (what a DTensor needs), from minddp's or stock's."""
    if isinstance(mesh, StockMesh):
        return mesh
    return StockMesh.from_group([mesh.get_group(0), mesh.get_group(1)], mesh.device_type,
                                mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)


class Hybrid(fsdp.Unit):
    """The lesson's Unit on a 2-D mesh: sharded over dimension 1, replicated over dimension 0."""

    def __init__(self, module, reshard_after_forward, mesh):
        self.replicate_group = mesh.get_group(0)
        self.replicas = dist.get_world_size(self.replicate_group)
        self.dp_mesh = stock_mesh(mesh)
        # Before any collective: a column of ranks with different models would broadcast
        # wrong shapes into each other (the row is checked as in 1-D, by the drop-in).
        check_same_model(module, self.replicate_group)
        super().__init__(module, reshard_after_forward, mesh.get_group(1))

    @torch.no_grad()
    def shard(self, name, users, param):
        """Collective: the column's first rank's weights down the column; then the row's."""
        if self.replicas > 1 and not param.is_meta:
            src = global_rank(self.replicate_group, 0)
            dist.broadcast(param, src=src, group=self.replicate_group)
        return super().shard(name, users, param)  # the lesson's: broadcast on the row, cut

    def as_dtensor(self, block, full):
        """Our rows of `full` on the 2-D mesh: the same on every rank of our column."""
        return DTensor.from_local(block, self.dp_mesh, [Replicate(), Shard(0)],
                                  run_check=False, shape=full.shape, stride=full.stride())

    @torch.no_grad()
    def reduce_scatter(self, params, grads):
        """Collective on both groups: each gradient averaged over every data-parallel rank,
        our rows kept. The order is stock's, so the bits are: averaged within the row first,
        those averages then averaged down the column (the other order rounds differently)."""
        before, after, op = divide_factors(grads[0].dtype, self.world_size * self.replicas)
        # The lesson's layout: row r of `flat` holds every parameter's block r, padded.
        flat = torch.cat([F.pad(g.reshape(len(g), -1), (0, 0, 0, p.rows * self.world_size - len(g)))
                          .view(self.world_size, -1) for p, g in zip(params, grads)], dim=1)
        if before not in (None, 1):
            flat.div_(before)
        mine = flat.view(-1) if self.world_size == 1 else flat.new_empty(flat.shape[1])
        if self.world_size > 1:
            dist.reduce_scatter_single(mine, flat.view(-1), op, self.group)
        if self.replicas > 1:
            # One all_reduce of the whole of `mine`, padding too, as stock's: gloo sums a
            # tensor round the ring in pieces, and where an element falls decides the order
            # its replicas are added in (one all_reduce per parameter fails the 4 x 1 tests).
            dist.all_reduce(mine, op, group=self.replicate_group)
        if after not in (None, 1):
            mine.div_(after)
        pieces = mine.split([p.block_numel for p in params])  # our rows, then padding
        return [self.as_dtensor(piece[:p.shard.to_local().numel()].view_as(p.shard.to_local()),
                                p.full) for p, piece in zip(params, pieces)]
