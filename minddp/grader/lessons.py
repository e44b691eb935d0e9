"""The grader's checks of two lessons that train nothing across ranks: the device mesh, and
recomputation.

    minddp grade exercises/mesh.py            # grade.py runs CHECKS[exercise] on every rank
    minddp grade exercises/recompute.py

mesh: grid_groups and grid_coordinate against stock's DeviceMesh (a pure function of the
shape, so every rank checks shapes of up to 24 ranks), then init_device_mesh at the world
size against stock's init_device_mesh: each dimension's process group, the coordinate, the
local ranks. recompute: checkpoint against torch.utils.checkpoint (non-reentrant), full and
selective, with dropout and without, three small models: the loss, every gradient, the
random state after backward, and the bytes kept from the forward for backward.
As in pieces.py: each check returns the same results on every rank.
"""

import functools
import gc
import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
# Stock's references, imported before any process group exists (as sharded.py's).
from torch.distributed.device_mesh import DeviceMesh as StockMesh
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as stock_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ..bench.recompute import Outputs as _Outputs  # what the forward leaves alive, measured
from .training import _everyone, _ranks, _result

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


# -- recompute -------------------------------------------------------------------------------


class _MLP(torch.nn.Module):
    """A residual MLP: up, GELU, dropout, down, plus the input."""

    def __init__(self, dropout):
        super().__init__()
        self.up, self.down, self.p = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), dropout

    def forward(self, x):
        return x + self.down(F.dropout(F.gelu(self.up(x)), self.p, training=True))


class _InPlace(_MLP):
    """The MLP with in-place ops: GELU's output shifted in place, dropout in place."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        h.add_(0.5)
        F.dropout(h, self.p, training=True, inplace=True)
        return self.down(h).sin()


def _block(dropout):
    from ..bench.transformer import Block
    return Block(16, 4, dropout=dropout)


MODELS = {"a residual MLP": (_MLP, (6, 8)), "an MLP with in-place ops": (_InPlace, (6, 8)),
          "a transformer block (attention, LayerNorms)": (_block, (2, 8, 16))}


def _recompute_cases():
    cases = [dict(model=m, policy=p, dropout=d, autocast=False, preserve=True)
             for m in MODELS for p in ("full", "selective") for d in (0.0, 0.5)]
    block = "a transformer block (attention, LayerNorms)"
    cases += [dict(model=block, policy=p, dropout=0.5, autocast=True, preserve=True)
              for p in ("full", "selective")]
    cases += [dict(model="a residual MLP", policy=p, dropout=0.5, autocast=False, preserve=False)
              for p in ("full", "selective")]
    return cases


def _case_label(case):
    return (f"{case['model']}, {case['policy']}" + (f", dropout {case['dropout']}" if
                                                     case["dropout"] else ", no dropout")
            + (", under autocast to bfloat16" if case["autocast"] else "")
            + (", preserve_rng_state=False" if not case["preserve"] else ""))


class _Count(TorchDispatchMode):
    """How many of save_ops' ops run meanwhile (in backward: run again)."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.n = set(ops), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.ops
        return func(*args, **(kwargs or {}))


def _run(case, how, save_ops, frozen):
    """One forward and backward: the loss, the gradients (the input's first), the random
    state after, and the bytes the forward left alive for backward. frozen: whether this
    process has set objects aside from the collector already (gc.get_freeze_count() > 0)."""
    # Everything made before this run is set aside from the collector, so gc.collect() below
    # reads this run's objects only (a full collection in a process with torch imported takes
    # 0.1-0.2 s). Safe here because the model and input are built inside the run: a module
    # built before a freeze could hold a cycle the collector no longer frees. A warm rank's
    # imports are set aside already (run/frozen.py), and an unfreeze would bring them back.
    if frozen:
        return _run_one(case, how, save_ops)
    gc.freeze()
    try:
        return _run_one(case, how, save_ops)
    finally:
        gc.unfreeze()


def _run_one(case, how, save_ops):
    build, shape = MODELS[case["model"]]
    torch.manual_seed(0)
    model = build(case["dropout"])
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saving = save_ops if case["policy"] == "selective" else ()
    if how == "stock":
        context = {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                   list(saving))} if saving else {}
        run = functools.partial(stock_checkpoint, model, use_reentrant=False,
                                preserve_rng_state=case["preserve"], **context)
    elif how == "none":
        run = model
    else:
        run = functools.partial(how, model, save_ops=saving, preserve_rng_state=case["preserve"])
    torch.manual_seed(2)  # dropout's masks
    with _Outputs() as outputs, torch.autocast("cpu", dtype=torch.bfloat16,
                                               enabled=case["autocast"]):
        y = run(x)
    gc.collect()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr(), 0}
    alive = {}
    for t in (ref() for ref in outputs.made):
        if t is not None and t.untyped_storage().data_ptr() not in skip:
            alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    torch.rand(3)  # a draw between forward and backward (the next block's dropout, say)
    loss = y.float().square().mean()
    with _Count(save_ops) as counted:
        loss.backward()
    grads = {"(the input's gradient)": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
    return {"(the loss)": loss.detach(), **{n: None if g is None else g.detach().clone()
                                            for n, g in grads.items()},
            "rng": torch.get_rng_state(), "kept": sum(alive.values()), "again": counted.n}


_REFERENCES = {}  # stock's runs and the plain ones: one process grades many files (the tests:
# every planted mistake on one set of ranks), each case's run once per state below


def _reference(case, how, save_ops, frozen):
    """_run(case, how, save_ops, frozen) for how = "stock" or "none", kept for the next file
    graded here while the process-wide state a student's code could leave changed is the same."""
    try:
        key = (tuple(case.items()), how, tuple(save_ops), _state())
        hash(key)
    except TypeError:  # (a student's save_ops that cannot be a key: run every time)
        return _run(case, how, save_ops, frozen)
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(case, how, save_ops, frozen)
    return _REFERENCES[key]


def _state():
    """What a checkpoint could leave set and a run would read: autocast, grad mode, the
    default dtype, determinism, threads, modes and saved-tensors hooks still pushed."""
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
            torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def recompute(student, rank, world_size):
    """The student's checkpoint against torch.utils.checkpoint's (non-reentrant): every case,
    shared out over the ranks, then gathered."""
    from ..memory.recompute import MATMULS
    save_ops = getattr(student, "MATMULS", MATMULS)
    cases = _recompute_cases()
    mine = range(rank, len(cases), world_size)
    # (counted once here: gc.get_freeze_count() walks every object set aside, 30 ms in a warm
    # rank, and only _run's own freeze, undone each time, changes it meanwhile)
    frozen = gc.get_freeze_count() > 0
    # Stock's runs and the plain ones first, before any of the student's code runs here.
    seen = {i: {how: _reference(cases[i], how, save_ops, frozen) for how in ("stock", "none")}
            for i in mine}
    for i in mine:
        try:
            seen[i]["yours"] = _run(cases[i], student.checkpoint, save_ops, frozen)
        except Exception as error:  # noqa: BLE001 (said as the case's verdict)
            if isinstance(error, NotImplementedError):
                raise  # (a TODO left: the grader says "not written yet")
            seen[i]["yours"] = f"{type(error).__name__}: {error}"
    merged = {}
    for part in _everyone(seen):
        merged.update(part)
    verdicts = [_recompute_verdict(case, merged[i]) for i, case in enumerate(cases)]
    results = []
    for policy in ("full", "selective"):
        mine = [(case, verdict) for case, verdict in zip(cases, verdicts)
                if case["policy"] == policy]
        failed = next(((case, v) for case, v in mine if v is not None), None)
        label = (f"{_ranks(world_size)}, {policy}: 3 models, with dropout and without, under"
                 f" autocast, preserve_rng_state=False")
        if failed is None:
            results.append(_result(label, True))
            continue
        case, (where, why) = failed
        results.append(_result(label, False, f"{_case_label(case)}: {where}",
                               _recompute_why(case, why, cases, verdicts)))
    results.append(_refuses_an_argument_changed(student, world_size))
    return results


def _refuses_an_argument_changed(student, world_size):
    """An argument changed in place between the forward and the backward: stock's refuses
    (autograd's version check), for the second forward would run on other numbers."""
    label = f"{_ranks(world_size)}, an argument changed in place after the forward"
    refused = []
    for how in (functools.partial(stock_checkpoint, use_reentrant=False), student.checkpoint):
        torch.manual_seed(0)
        model, x = MODELS["a residual MLP"][0](0.0), torch.randn(6, 8)
        try:
            y = how(model, x)
        except Exception as error:  # noqa: BLE001 (a forward that raises: said by the cases
            if isinstance(error, NotImplementedError):  # above; a TODO: "not written yet")
                raise
            return _result(label, False, "checkpoint(model, x)", f"the forward raised:"
                           f" {type(error).__name__}: {error}")
        x.add_(1.0)
        try:
            y.square().mean().backward()
            refused.append(False)
        except RuntimeError:
            refused.append(True)
    if refused == [True, True]:
        return _result(label, True)
    return _result(label, False, "x.add_(1.0) between checkpoint(model, x) and backward",
                   "the argument changed in place, and yours ran the second forward on the new"
                   " numbers: stock's refuses (the version counter moved); note each tensor"
                   " argument's _version at the forward, and raise in the recompute if one"
                   " moved" if refused[0] else "stock's did not refuse: the grader's case is"
                   " wrong here")


def _recompute_verdict(case, runs):
    """None, or (where, what) for the first thing that differs from stock's."""
    yours, stock, none = runs["yours"], runs["stock"], runs["none"]
    if isinstance(yours, str):
        return "the run", ("raised", yours)
    for name, want in stock.items():
        if name in ("rng", "kept", "again"):
            continue
        got = yours[name]
        if got is None or want is None:
            if (got is None) != (want is None):
                return name, ("presence", name)
            continue
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name}: yours {got.dtype} {tuple(got.shape)}, stock's {want.dtype}" \
                   f" {tuple(want.shape)}", ("value", name)
        if not torch.equal(got, want):
            at = tuple(int(i) for i in (got != want).nonzero()[0])
            return (f"{name}, element {at}: yours {float(got[at]):.6g}, stock's"
                    f" {float(want[at]):.6g}", ("value", name))
    if not torch.equal(yours["rng"], stock["rng"]):
        return "the random state after backward", ("rng", None)
    if yours["kept"] != stock["kept"]:
        return (f"bytes kept from the forward for backward: yours {yours['kept']}, stock's"
                f" {stock['kept']} (without checkpointing {none['kept']})",
                ("kept", (yours["kept"], stock["kept"], none["kept"])))
    if case["policy"] == "selective" and yours["again"] > stock["again"]:
        return (f"the matmuls and attention run in backward: yours {yours['again']}, stock's"
                f" {stock['again']}", ("again", None))
    return None


def _twin(case, cases, verdicts, **change):
    other = {**case, **change}
    return next((v for c, v in zip(cases, verdicts) if c == other), "none")


def _recompute_why(case, why, cases, verdicts):
    kind, what = why
    if kind == "kept":
        yours, stock, none = what
        if yours >= none:
            return (f"nothing dropped: yours keeps {yours} bytes for backward, as much as no"
                    f" checkpointing ({none}); stock's keeps {stock}. Keep only the arguments:"
                    f" each tensor an op saves packed as its number, got back by running the"
                    f" forward again in backward")
        if case["policy"] == "selective" and yours < stock:
            return (f"selective keeps less than stock's ({yours} bytes, stock's {stock}):"
                    f" the outputs of save_ops were not kept in the forward (Keep) and handed"
                    f" back in the second (Reuse): the matmuls run again")
        return f"yours keeps {yours} bytes for backward, stock's {stock}"
    if kind == "again":
        return ("selective runs the ops of save_ops again in backward: their outputs, kept in"
                " the forward (Keep), must be handed back in the second forward instead"
                " (Reuse), or selective costs what full does")
    if kind == "rng":
        return ("every gradient is stock's, but not the random state after backward"
                + (": the second forward left it where set_rng_state and its own draws put"
                   " it; stock's puts it back as it was when backward asked (the second"
                   " forward inside torch.random.fork_rng)"
                   if case["preserve"] else ": with preserve_rng_state=False stock stashes no"
                   " state and leaves the RNG where the second forward's draws left it"))
    plain = _twin(case, cases, verdicts, dropout=0.0, autocast=False, preserve=True)
    if not case["preserve"] and _twin(case, cases, verdicts, preserve=True) is None:
        return ("with preserve_rng_state=False stock stashes no random state: the second"
                " forward draws new dropout masks from the RNG as it stands (stock's flag,"
                " stock's meaning)")
    if case["autocast"] and _twin(case, cases, verdicts, autocast=False) is None:
        return ("under autocast only: the second forward did not run under the first one's"
                " autocast (enabled, dtype), so its ops saved tensors of another precision:"
                " put the autocast state back" + (f" (it raised: {what})" if kind == "raised"
                                                   else ""))
    if case["dropout"] and plain is None:
        return ("only where dropout draws: the second forward drew other masks than the"
                " first: the random state was not replayed (torch.get_rng_state() before the"
                " forward, torch.set_rng_state() before running it again)"
                + (f"; it raised: {what}" if kind == "raised" else ""))
    if kind == "raised":
        return f"an exception in this case: {what}"
    if kind == "presence":
        return f"{what}: a gradient on one side only"
    return (f"the first that differs is {what}: the tensors the backward got back are not"
            f" those the first forward saved (each number answered by the tensor saved in"
            f" that order)" if what != "(the loss)" else
            "the loss differs: the forward itself is not the function's")


CHECKS = {"mesh": mesh, "recompute": recompute}
