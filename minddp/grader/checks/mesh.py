"""The device mesh's check: grid_groups, grid_coordinate and init_device_mesh against stock's.

    minddp grade exercises/mesh.py            # grade.py runs CHECKS["mesh"] on every rank

grid_groups and grid_coordinate against stock's DeviceMesh (a pure function of the shape,
so every rank checks shapes of up to 24 ranks), then init_device_mesh at the world size
against stock's init_device_mesh: each dimension's process group, the coordinate, the
local ranks. As every check: it returns the same results on every rank.
"""

import itertools
import math

import torch
import torch.distributed as dist
# Stock's references, imported before any process group exists (as zero.py's).
from torch.distributed.device_mesh import DeviceMesh as StockMesh
from torch.distributed.device_mesh import init_device_mesh as stock_mesh

from ..shared.training import _everyone, _ranks, _result


# Shapes checked in every rank, whatever the world size: no process group is made for them.
SHAPES = ((2, 2), (2, 4), (4, 2), (3, 2), (2, 3), (2, 2, 2), (2, 3, 4), (4, 1, 2), (1, 4),
          (4, 1), (5,), (1,), (2, 2, 3, 2))
NAMES = ("ep", "pp", "dp", "tp")


def _world_shapes(world_size):
    """The meshes of world_size ranks graded with real groups: 1-D, every 2-D, and the 3-D
    ones with the most dimensions longer than 1."""
    pairs = [(a, world_size // a) for a in range(1, world_size + 1) if world_size % a == 0]
    triples = [t for t in itertools.product(range(1, world_size + 1), repeat=3)
               if math.prod(t) == world_size]
    most = max(sum(s > 1 for s in t) for t in triples)
    return [(world_size,), *pairs, *[t for t in triples if sum(s > 1 for s in t) == most]]


def _stock_lines(shape, dim):
    """Stock's groups along `dim`: the lines of its mesh tensor through each choice of the
    other coordinates (the ranks that differ only in coordinate `dim`)."""
    mesh = _stock_tensor(shape)
    others = [range(s) if d != dim else [slice(None)] for d, s in enumerate(shape)]
    return [mesh[index].tolist() for index in itertools.product(*others)]


def _stock_tensor(shape):
    return StockMesh("cpu", torch.arange(math.prod(shape)).view(shape), _init_backend=False,
                     _rank=0).mesh


def _stock_coordinate(shape, rank):
    return list(StockMesh("cpu", torch.arange(math.prod(shape)).view(shape),
                          _init_backend=False, _rank=rank).get_coordinate())


def _listed(groups):
    """The student's groups as lists of ints (tensors and tuples accepted), or None."""
    try:
        return [[int(r) for r in group] for group in groups]
    except (TypeError, ValueError):
        return None


def mesh(student, rank, world_size):
    """grid_groups and grid_coordinate against stock's mesh; then init_device_mesh's groups,
    coordinate and local ranks at this world size against stock's init_device_mesh."""
    world = _world_shapes(world_size)
    shapes = [s for s in world if s not in SHAPES] + list(SHAPES)
    label = (f"the meshes of {_ranks(world_size)} and {len(shapes) - len(world)} more of up to"
             f" {max(map(math.prod, shapes))} ranks, 1-D to {max(map(len, shapes))}-D")
    results = []
    groups = {(shape, dim): (_listed(student.grid_groups(shape, dim)), _stock_lines(shape, dim))
              for shape in shapes for dim in range(len(shape))}
    results.append(_result(f"{_ranks(world_size)}, grid_groups: every dimension of {label}",
                           *_groups_verdict(groups)))
    coordinates = {(shape, r): (_listed([student.grid_coordinate(shape, r)]),
                                _stock_coordinate(shape, r))
                   for shape in shapes for r in range(math.prod(shape))}
    results.append(_result(f"{_ranks(world_size)}, grid_coordinate: every rank of {label}",
                           *_coordinate_verdict(coordinates)))
    seen = {}
    for shape in world:
        names = NAMES[-len(shape):]
        stock = stock_mesh("cpu", shape, mesh_dim_names=names)
        theirs = _mesh_record(stock, names)
        # Only lines that split the ranks make groups: others may hang in dist.new_group.
        bad = next((d for d in range(len(shape)) if not _splits(groups[shape, d][0], shape, d)),
                   None)
        yours = (f"not built: grid_groups({shape}, {bad}) does not split the ranks into lines"
                 f" of {shape[bad]}" if bad is not None else
                 _mesh_record(student.init_device_mesh("cpu", shape, mesh_dim_names=names),
                              names))
        seen[shape] = (yours, theirs)
    everyone = _everyone(seen)
    results.append(_result(f"{_ranks(world_size)}, init_device_mesh of"
                           f" {', '.join(str(s).replace(',)', ')') for s in world)}: each"
                           f" dimension's group, the coordinate, the local ranks",
                           *_world_verdict(everyone, world)))
    return results


def _mesh_record(mesh, names):
    def ranks(group):
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        return dist.get_process_group_ranks(group)
    return {"coordinate": [int(c) for c in mesh.get_coordinate()],
            **{f"{name}'s group": ranks(mesh.get_group(name)) for name in names},
            **{f"get_local_rank({name!r})": int(mesh.get_local_rank(name)) for name in names}}


def _splits(groups, shape, dim):
    return groups is not None and all(len(g) == shape[dim] for g in groups) and sorted(
        sum(groups, [])) == list(range(math.prod(shape)))


def _groups_verdict(groups):
    for (shape, dim), (yours, stock) in groups.items():
        if yours is not None and sorted(yours) == sorted(stock):
            continue  # the groups in any order: each is made once, by every rank alike
        if yours is None:
            return False, f"grid_groups({shape}, {dim})", (
                "not a list of groups, each a list of global ranks")
        mine = {r: g for g in stock for r in g}
        r = next((r for r in range(math.prod(shape)) if not any(g == mine[r] for g in yours)), 0)
        found = next((g for g in yours if r in g), None)
        where = (f"grid_groups({shape}, {dim}): the group of rank {r}: yours {found}, stock's"
                 f" {mine[r]}")
        return False, where, _everywhere(groups, shape, dim) or _groups_why(yours, stock,
                                                                              shape, dim)
    return True, "", ""


def _everywhere(groups, shape, dim):
    """A mistake the student's groups make at every shape and dimension: the slices through
    the grid, or blocks of consecutive ranks (one shape alone may not tell them apart)."""
    def every(rule):
        return all(yours is not None and sorted(map(sorted, yours)) == sorted(
            map(sorted, rule(shape, dim))) for (shape, dim), (yours, _) in groups.items())
    size = shape[dim]
    if every(lambda shape, dim: [m.flatten().tolist() for m in _stock_tensor(shape).unbind(dim)]):
        return (f"the ranks that share coordinate {dim} (the slice through the grid at each"
                f" index of dimension {dim}), not those that differ only in it: along dimension"
                f" {dim} each group is a line of shape[{dim}] = {size} ranks, one per index")
    if every(lambda shape, dim: [list(range(i, i + shape[dim])) for i in
                                 range(0, math.prod(shape), shape[dim])]):
        return (f"blocks of {size} consecutive ranks, at every dimension: consecutive ranks are"
                f" a line along the last dimension only; along dimension {dim} a group's ranks"
                f" lie {math.prod(shape[dim + 1:])} apart (the product of the later sizes)")
    return None


def _groups_why(yours, stock, shape, dim):
    n, size = math.prod(shape), shape[dim]
    flat = sorted(sum(yours, []))
    if flat != list(range(n)):
        missing = sorted(set(range(n)) - set(flat))
        twice = sorted({r for r in flat if flat.count(r) > 1})
        said = [f"ranks {missing} in no group"] * bool(missing) + [f"ranks {twice} in two"] * \
            bool(twice)
        return (f"not every rank exactly once: {', '.join(said)}:"
                f" the groups of one dimension split all {n} ranks, one group per choice of the"
                f" other coordinates")
    if sorted(map(sorted, yours)) == sorted(stock):
        return (f"the right ranks, in another order within a group: along dimension {dim} a"
                f" group lists its ranks in the order of their coordinate {dim} (a rank's group"
                f" rank there is that coordinate)")
    canonical = sorted(map(sorted, yours))
    others = [e for e in range(len(shape)) if e != dim and canonical == sorted(
        _stock_lines(shape, e))]
    blocks = canonical == [list(range(i, i + size)) for i in range(0, n, size)]
    stride = math.prod(shape[dim + 1:])
    if others:
        return (f"stock's groups along dimension {others[0]}, not {dim}: a group along"
                f" dimension {dim} holds the ranks that differ only in coordinate {dim}, the"
                f" others fixed" + (f"; consecutive ranks are a line along the last dimension"
                                    f" only: along {dim} they lie {stride} apart (the product of"
                                    f" the later sizes)" if blocks else ""))
    if blocks:
        return (f"blocks of {size} consecutive ranks: consecutive ranks are a line along the"
                f" last dimension only; along dimension {dim} a group's ranks lie {stride}"
                f" apart (the product of the later sizes)")
    slices = [mesh.flatten().tolist() for mesh in _stock_tensor(shape).unbind(dim)]
    if canonical == sorted(slices):
        return (f"the ranks that share coordinate {dim} (the slice through the grid at each"
                f" index of dimension {dim}), not those that differ only in it: along dimension"
                f" {dim} each group is a line of shape[{dim}] = {size} ranks")
    sizes = sorted({len(g) for g in yours})
    if sizes != [size]:
        return (f"groups of {', '.join(map(str, sizes))} ranks: along dimension {dim} each group"
                f" holds shape[{dim}] = {size} ranks, one per index, and there are {n // size}")
    return ("other groups than stock's: a group along dimension d holds the ranks whose other"
            " coordinates are equal (row-major: the last dimension varies fastest)")


def _column_major(shape, rank):
    out = []
    for s in shape:
        rank, c = divmod(rank, s)
        out.append(c)
    return out


def _coordinate_verdict(coordinates):
    for (shape, r), (yours, stock) in coordinates.items():
        if yours is not None and yours[0] == stock:
            continue
        where = (f"grid_coordinate({shape}, {r}): yours {yours[0] if yours else yours}, stock's"
                 f" {stock}")
        if yours is None or len(yours[0]) != len(shape):
            return False, where, (f"not one index per dimension: a {len(shape)}-D grid's"
                                  f" coordinate has {len(shape)} of them")
        every = [(y[0] if y else None, s, _column_major(sh, k))
                 for (sh, k), (y, s) in coordinates.items()]
        if all(y == s[::-1] for y, s, _ in every):
            return False, where, ("the indices listed last dimension first: a coordinate holds"
                                  " one index per dimension, in the dimensions' order")
        if all(y == c for y, _, c in every):
            return False, where, ("column-major: your first dimension varies fastest; stock's"
                                  " grid is row-major, torch.arange(n).reshape(shape): the last"
                                  " dimension varies fastest")
        return False, where, (f"rank {r} sits at {stock} in stock's row-major grid: index d is"
                              f" rank // (the product of the sizes after d) % shape[d]")
    return True, "", ""


def _world_verdict(everyone, world):
    for shape in world:
        for rank, seen in enumerate(everyone):
            yours, stock = seen[shape]
            if isinstance(yours, str):
                return False, f"mesh {shape}, rank {rank}", (
                    f"{yours}: see grid_groups's check")
            for key, want in stock.items():
                if yours.get(key) == want:
                    continue
                where = (f"mesh {shape} {NAMES[-len(shape):]}, rank {rank}, {key}: yours"
                         f" {yours.get(key)}, stock's {want}")
                if key == "coordinate":
                    return False, where, "get_coordinate() is not stock's: grid_coordinate"
                if key.endswith("'s group"):
                    return False, where, (
                        f"the process group this rank joins along {key[:-8]} is not stock's:"
                        f" made from grid_groups's lines, each rank keeps the one it is in")
                return False, where, ("this rank's local rank (its group rank, its coordinate"
                                      " there) is not stock's: grid_coordinate")
    return True, "", ""
