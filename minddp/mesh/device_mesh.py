"""The device mesh by hand: the world as a grid of named dimensions, one group per line of it.

    pytest tests/test_mesh.py     # every group of every dimension: init_device_mesh's ranks

Every lesson so far spreads one idea over all the ranks it is given (a `group`). Real
training composes them: 8 ranks as a 2 x 2 x 2 grid, pipeline stages along one dimension,
data parallel along the next, tensor parallel along the last. Rank r sits at the grid
coordinates of r in row-major order (the last dimension varies fastest), and each dimension
gives it one group: the ranks that differ from it in that coordinate only. For
mesh_shape (2, 2), names ("dp", "tp"):

        tp ->        rank 0's tp group: [0, 1] (a row),  its dp group: [0, 2] (a column)
    dp  [[0, 1],     rank 3's tp group: [2, 3],          its dp group: [1, 3]
     v   [2, 3]]

So tensor parallel (which talks at every layer) joins neighbouring ranks, which on a real
machine share the fastest links; data parallel (once per step) spans the far ones. In the
order they appear below:
  grid_groups     the ranks of every group of one dimension: lines through the grid
  grid_coordinate   where a rank sits in the grid: one index per dimension
  DeviceMesh      the grid, its groups made once, a rank's coordinates and neighbours;
                  mesh["tp"] is the 1-D mesh of this rank's tp group, what lessons take;
                  mesh["dp_replicate", "dp_shard"] a 2-D one (HSDP's, dropin/hsdp.py)
  init_device_mesh   stock's call: check the shape, then build the grid
Stock's API (torch.distributed.device_mesh): init_device_mesh("cpu", (2, 2),
mesh_dim_names=("dp", "tp")), then mesh["tp"].get_group(), mesh.get_coordinate(),
mesh.get_local_rank("dp"); each 1-D slice goes where a lesson takes a mesh or a group.
"""

import itertools
import math

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError


def grid_groups(shape, dim):
    """The global ranks of each group along dimension `dim` of a row-major grid of `shape`.

    One group per choice of the other coordinates; within it, ranks in order along `dim`.
    """
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    # Move `dim` last and flatten the rest: each row is then one line through the grid.
    lines = ranks.movedim(dim, -1).reshape(-1, shape[dim])
    return [line.tolist() for line in lines]


def grid_coordinate(shape, rank):
    """Where `rank` sits in a row-major grid of `shape`: one index per dimension."""
    ranks = torch.arange(math.prod(shape)).reshape(shape)
    return [int(c) for c in (ranks == rank).nonzero()[0]]


class DeviceMesh:
    """A grid of ranks with named dimensions, and this rank's group along each.

    Collective to build: every rank makes every group of every dimension, in the same
    order (dist.new_group must be called by all ranks, even for groups they are not in).
    """

    def __init__(self, device_type, shape, names, groups=None, rank=None):
        self.device_type = device_type
        self.shape = tuple(shape)
        self.mesh_dim_names = tuple(names)
        self.mesh = torch.arange(math.prod(shape)).reshape(self.shape)
        rank = dist.get_rank() if rank is None else rank
        self._rank = rank
        # A rank's coordinates: where it sits in the grid, one number per dimension.
        self._coordinate = grid_coordinate(self.shape, rank)
        if groups is None:
            groups = [self._make_group(dim) for dim in range(len(self.shape))]
        self._groups = groups

    def _make_group(self, dim):
        mine = None
        for ranks in grid_groups(self.shape, dim):
            # Every rank makes every group; it keeps the one it is in.
            group = dist.new_group(ranks) if len(ranks) < self.mesh.numel() else dist.group.WORLD
            if self._rank in ranks:
                mine = group
        return mine

    @property
    def ndim(self):
        return len(self.shape)

    def size(self, mesh_dim=None):
        """How many ranks: in the whole grid, or along one dimension (index or name)."""
        return self.mesh.numel() if mesh_dim is None else self.shape[self._dim(mesh_dim)]

    def get_group(self, mesh_dim=None):
        """This rank's group along `mesh_dim` (only a 1-D mesh may leave it out)."""
        if mesh_dim is None and self.ndim != 1:
            raise UsageError(f"get_group() on a {self.ndim}-D mesh {self.mesh_dim_names} needs"
                             f" a dimension",
                             hint='mesh.get_group("tp"), or mesh["tp"].get_group()')
        return self._groups[self._dim(mesh_dim or 0)]

    def get_coordinate(self):
        """This rank's place in the grid: one index per dimension."""
        return list(self._coordinate)

    def get_local_rank(self, mesh_dim=None):
        """This rank's index within its group along `mesh_dim` (its group rank there)."""
        return self._coordinate[self._dim(mesh_dim or 0)]

    def neighbours(self, mesh_dim):
        """The global ranks before and after this one along `mesh_dim` (None at the ends):
        who a pipeline stage receives activations from, and sends them to."""
        dim = self._dim(mesh_dim)
        line = grid_groups(self.shape, dim)
        ranks = next(r for r in line if self._rank in r)
        here = ranks.index(self._rank)
        before = ranks[here - 1] if here > 0 else None
        after = ranks[here + 1] if here + 1 < len(ranks) else None
        return before, after

    def __getitem__(self, names):
        """mesh["tp"]: the 1-D mesh of this rank's tp group; mesh["dp_replicate", "dp_shard"]:
        the 2-D grid of those dimensions through this rank (no new group is made)."""
        dims = [self._dim(n) for n in (names if isinstance(names, (tuple, list)) else [names])]
        if dims != sorted(set(dims)):  # stock's rule: the grid keeps the mesh's order
            raise UsageError(f"mesh[{names}]: dimensions go in the mesh's order,"
                             f" {self.mesh_dim_names}", hint="name them outermost first",
                             same_on_every_rank=True)
        # This rank's coordinates fix every other dimension; the named ones run free.
        index = [slice(None) if d in dims else c for d, c in enumerate(self._coordinate)]
        sub = DeviceMesh.__new__(DeviceMesh)
        sub.device_type = self.device_type
        sub.mesh_dim_names = tuple(self.mesh_dim_names[d] for d in dims)
        sub.mesh = self.mesh[tuple(index)]
        sub.shape = tuple(sub.mesh.shape)
        sub._rank, sub._coordinate = self._rank, [self._coordinate[d] for d in dims]
        sub._groups = [self._groups[d] for d in dims]
        return sub

    def _dim(self, mesh_dim):
        if isinstance(mesh_dim, int) and 0 <= mesh_dim < self.ndim:
            return mesh_dim
        if mesh_dim in self.mesh_dim_names:
            return self.mesh_dim_names.index(mesh_dim)
        raise UsageError(f"mesh dimension {mesh_dim!r} is not one of {self.mesh_dim_names}",
                         hint="use a name given to init_device_mesh(mesh_dim_names=...)",
                         same_on_every_rank=True)

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape))
        return f"DeviceMesh({self.device_type!r}, {dims}, ranks {self.mesh.flatten().tolist()})"


def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None):
    """Stock's init_device_mesh: a DeviceMesh of `mesh_shape` over every rank. Collective."""
    shape = tuple(mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(
        f"dim_{i}" for i in range(len(shape)))
    check_mesh(shape, names, dist.get_world_size())
    return DeviceMesh(device_type, shape, names)


def check_mesh(shape, names, world_size):
    """One line, on every rank alike, before any group is made: a shape that does not fit."""
    said = ", ".join(f"{n}={s}" for n, s in itertools.zip_longest(names, shape, fillvalue="?"))
    if len(names) != len(shape):
        raise UsageError(f"mesh_dim_names has {len(names)} names for a {len(shape)}-D"
                         f" mesh ({said})", hint="one name per dimension", same_on_every_rank=True)
    if len(set(names)) != len(names):
        raise UsageError(f"mesh dimension names repeat: {names}",
                         hint="name each dimension once", same_on_every_rank=True)
    if any(not isinstance(s, int) or s < 1 for s in shape):
        raise UsageError(f"mesh shape {shape}: every dimension needs at least one rank",
                         hint="sizes are whole numbers >= 1", same_on_every_rank=True)
    if math.prod(shape) != world_size:
        raise UsageError(f"a mesh of {said} holds {math.prod(shape)} ranks, but the world has"
                         f" {world_size}", hint=f"make the sizes multiply to {world_size}",
                         same_on_every_rank=True)

