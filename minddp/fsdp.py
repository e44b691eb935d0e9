"""FSDP by hand (ZeRO-3): every rank keeps a shard of each weight and gathers a layer just in time.

    torchrun --nproc_per_node=2 examples/fsdp.py --grad-table runs/fsdp.txt
    python -m minddp.fsdp_bench              # bytes per rank: DDP, ZeRO-1, FSDP, stock fully_shard

DDP keeps the whole model on every rank: weights, gradients and optimizer state, world_size
times over. ZeRO-1 (zero.py) shards the optimizer state. FSDP shards the rest too:

  shard      each parameter is cut into world_size row blocks (dim 0, padded with zero rows
             to a multiple of world_size); a rank keeps its block. Its optimizer sees blocks.
  unshard    just before a unit (a module given to fully_shard) runs forward, one all_gather
             puts every rank's blocks together into full weights;
  reshard    right after, the full weights' memory is freed (the blocks stay);
  backward   the unit's backward needs its weights again: unshard before it, reshard after;
  reduce     one reduce_scatter sums the unit's gradients over ranks and hands each rank the
             rows of its own block (averaged), all its optimizer step needs.

At most one unit is full at a time (stock prefetches the next one: two). The price: each
weight travels twice per step (forward and backward all_gather) besides the reduce_scatter,
3 x P x (W-1)/W per step where DDP's all_reduce sends 2 x. reshard_after_forward=False keeps
a unit full from its forward to its backward: one all_gather fewer, more memory (ZeRO-2-like).

The API is PyTorch's: `fully_shard(block)` for each block, then `fully_shard(model)` for the
rest; build the optimizer afterwards. Each rank's blocks equal `fully_shard`'s `to_local()`
bit for bit (tests/test_fsdp.py): the same layout, the same collectives, the same dtypes.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .broadcast import check_same_model
from .errors import UsageError


def _all_gather(output, input, group):
    # torch 2.13 calls it all_gather_single; older releases all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group)


def _reduce_scatter(output, input, op, group):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in param_dtype (gathered in it), reduce gradients in reduce_dtype (stock's names)."""
    param_dtype: torch.dtype = None
    reduce_dtype: torch.dtype = None
    output_dtype: torch.dtype = None
    cast_forward_inputs: bool = True


def fully_shard(module, *, reshard_after_forward=None, mp_policy=None, process_group=None):
    """Shard `module`'s parameters (those not in an inner unit) over the ranks; returns module.

    Collective: call on every rank. Inner blocks first, the root last; then build the optimizer.
    reshard_after_forward: free the full weights after forward (default: yes, but the root's
    are kept, as stock keeps them: its backward starts at once and would gather them again).
    """
    if hasattr(module, "_fsdp_unit"):
        raise UsageError(f"fully_shard was already applied to this {type(module).__name__}",
                         hint="call fully_shard once per module", same_on_every_rank=True)
    _refuse_stale_optimizers()
    module._fsdp_unit = Unit(module, reshard_after_forward, mp_policy or MixedPrecisionPolicy(),
                             process_group)
    return module


class Unit:
    """The parameters of one fully_shard call: one all_gather and one reduce_scatter for all."""

    def __init__(self, module, reshard_after_forward, mp_policy, group):
        self.module, self.mp, self.group = module, mp_policy, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.reshard_after_forward = reshard_after_forward  # None: decided when the root is known
        self.root = None  # the outermost unit, found at the first forward
        owners = _owned_parameters(module)
        check_same_model(module, group, tensors=[(name, p) for name, _, p in owners])
        dtypes = {mp_policy.param_dtype or p.dtype for _, _, p in owners}
        if len(dtypes) > 1:  # one flat buffer per unit holds one dtype
            raise UsageError(f"the {type(module).__name__} given to fully_shard mixes parameter"
                             f" dtypes {sorted(map(str, dtypes))}", same_on_every_rank=True,
                             hint="fully_shard the submodules of each dtype as units of their"
                                  " own, or set mp_policy=MixedPrecisionPolicy(param_dtype=...)")
        self.device = owners[0][2].device if owners else torch.device("cpu")
        self.params = [self._shard(name, users, param) for name, users, param in owners]
        self.is_unsharded = False
        self._backward_done = True
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    # -- shard: each rank keeps a block of rows of every parameter -------------------------
    @torch.no_grad()
    def _shard(self, name, users, param):
        if param.dim() == 0:
            raise UsageError(f"parameter {name!r} is a scalar: FSDP shards along dim 0",
                             hint="make it a 1-element vector", same_on_every_rank=True)
        if self.world_size > 1:  # start from rank 0's weights, as DDP does
            dist.broadcast(param, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                           group=self.group)
        rows = math.ceil(param.shape[0] / self.world_size)  # torch.chunk's block: the last
        start = min(self.rank * rows, param.shape[0])       # blocks may be short or empty
        block = param[start:start + rows].clone()
        shard = torch.nn.Parameter(block, requires_grad=param.requires_grad)
        shard._fsdp_full_shape = param.shape  # (gradient tables record whole gradients)
        # The full weight the module computes with: same shape, storage freed between uses.
        full = torch.nn.Parameter(torch.empty(param.shape, dtype=self.mp.param_dtype or param.dtype,
                                              device=param.device),
                                  requires_grad=param.requires_grad)
        full.untyped_storage().resize_(0)
        param._fsdp_replaced_by = shard  # an optimizer still holding `param` is told so
        p = _Param(name, users, shard, full, rows)
        p.show(shard)  # the model's parameters are now the shards
        return p

    # -- unshard / reshard ------------------------------------------------------------------
    @torch.no_grad()
    def unshard(self):
        """Collective: all_gather the unit's blocks; the module then holds full weights."""
        if self.is_unsharded or not self.params:
            return  # (a root with no parameters of its own only hosts the end-of-backward)
        dtype = self.params[0].full.dtype
        # One flat buffer for the whole unit, each block padded to `rows` rows: one collective,
        # and every rank's piece the same size (all_gather needs that).
        sizes = [p.rows * p.row_numel for p in self.params]
        gathered = torch.empty(self.world_size * sum(sizes), dtype=dtype, device=self.device)
        flat = gathered.view(self.world_size, -1)[self.rank]  # our slot: gathered in place
        for p, piece in zip(self.params, flat.split(sizes)):
            piece[:p.shard.numel()].copy_(p.shard.reshape(-1))  # the cast to param_dtype
            piece[p.shard.numel():].zero_()  # the padding rows
        if self.world_size > 1:
            _all_gather(gathered, flat, group=self.group)
        for p, piece in zip(self.params, gathered.view(self.world_size, -1).split(sizes, dim=1)):
            p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
            # piece[r] is rank r's block; the weight is the blocks one after another, less
            # the padding. `.data` writes without bumping the version counter: autograd saved
            # `full` in an earlier forward and must find the same tensor, refilled, in backward.
            for r, block in enumerate(p.full.data.view(-1).split(p.rows * p.row_numel)):
                block.copy_(piece[r, :block.numel()])
            p.show(p.full)
        self.is_unsharded = True

    def reshard(self):
        """Free the full weights' memory; the module holds its blocks again."""
        if not self.is_unsharded:
            return
        for p in self.params:
            p.full.untyped_storage().resize_(0)  # the tensor stays, for autograd; its bytes go
            p.show(p.shard)
        self.is_unsharded = False

    # -- the hooks: when to unshard, reshard and reduce -------------------------------------
    def _pre_forward(self, module, args, kwargs):
        if self.root is None:
            self._find_units()  # the first unit to run forward is the root
        self.unshard()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        if torch.is_grad_enabled():
            # Hear when backward has passed through this unit: the gradient arrives at its
            # inputs only after every gradient inside it is computed.
            args, kwargs = _notify_when_done(self, (args, kwargs))
        return args, kwargs

    def _post_forward(self, module, args, output):
        if self.reshard_after_forward:
            self.reshard()
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:  # backward reaches the unit through its outputs
                    t.register_hook(self._pre_backward)
            self._backward_done = False
        if self.mp.output_dtype is not None:
            output = _cast_floats(output, self.mp.output_dtype)
        return output

    def _pre_backward(self, grad):
        if self._backward_done:
            return grad  # another output of a unit whose backward has already finished
        self.unshard()  # gathered again: the weights were freed after forward
        if not self.root._callback_queued:  # once per backward: after the engine's last node
            self.root._callback_queued = True
            Variable._execution_engine.queue_callback(self.root._end_of_backward)
        return grad

    def post_backward(self):
        """Collective: reduce_scatter the unit's gradients into its blocks' .grad; reshard."""
        self._backward_done = True
        with_grad = [p for p in self.params if p.full.grad is not None]
        self.reshard()
        if with_grad:
            self._reduce_scatter(with_grad)

    def _end_of_backward(self):
        # Units whose inputs needed no gradient (the first block, the root) never heard
        # _BackwardDone; their gradients are complete now, at the end of backward.
        self._callback_queued = False
        for unit in reversed(self.units):
            if not unit._backward_done:
                unit.post_backward()

    # -- reduce_scatter: sum over ranks, keep your own rows ---------------------------------
    @torch.no_grad()
    def _reduce_scatter(self, params):
        reduce_dtype = self.mp.reduce_dtype or params[0].full.grad.dtype
        # Lay every gradient out as the all_gather did: padded to world_size blocks of rows,
        # row r of `flat` holds every parameter's block r, the part rank r keeps.
        flat = torch.cat([_padded_rows(p.full.grad, p.rows * self.world_size)
                          .view(self.world_size, -1) for p in params], dim=1).to(reduce_dtype)
        for p in params:
            p.full.grad = None  # the full gradient is freed: only the block's rows stay
        mine = flat.view(-1)  # one rank: its own sum is the average
        if self.world_size > 1:
            mine = torch.empty(flat.shape[1], dtype=reduce_dtype, device=self.device)
            # AVG, as stock asks on fp32 and bf16 (gloo sums, then divides by world_size;
            # DDP instead multiplies by 1/world_size first: at 3 ranks the last bit can differ).
            _reduce_scatter(mine, flat.view(-1), op=dist.ReduceOp.AVG, group=self.group)
        for p, piece in zip(params, mine.split([p.rows * p.row_numel for p in params])):
            grad = piece[:p.shard.numel()].view(p.shard.shape).to(p.shard.dtype)
            p.shard.grad = grad if p.shard.grad is None else p.shard.grad + grad

    def _find_units(self):
        self.units = _units(self.module)
        self._callback_queued = False
        for unit in self.units:
            unit.root = self
            if unit.reshard_after_forward is None:  # auto: yes, except for the root
                unit.reshard_after_forward = unit is not self


def _units(module):
    return [m._fsdp_unit for m in module.modules() if hasattr(m, "_fsdp_unit")]


@dataclass
class _Param:
    name: str                    # its name under the unit's module ("0.weight")
    users: list                  # (module, attribute) pairs that hold it (two if tied)
    shard: torch.nn.Parameter    # this rank's block: what the optimizer updates
    full: torch.nn.Parameter     # the whole weight, allocated only while unsharded
    rows: int                    # rows per block (the padded dim 0 / world_size)

    @property
    def row_numel(self):
        return math.prod(self.full.shape[1:])

    def show(self, tensor):
        """Point every module that holds this parameter at `tensor` (the shard or the full)."""
        for module, attr in self.users:
            module._parameters[attr] = tensor


class _BackwardDone(torch.autograd.Function):
    """Passes the unit's inputs through; its backward runs when the unit's backward is done."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


def _owned_parameters(module):
    """(name, [(owner, attribute), ...], parameter) for module's parameters not in an inner unit.

    A weight tied between two modules of the unit (a language model's embedding and output
    layer) is one parameter with two users: sharded once, gathered once.
    """
    found = {}
    inner = [m for m in module.modules() if m is not module and hasattr(m, "_fsdp_unit")]
    for prefix, owner in module.named_modules(remove_duplicate=False):
        if any(_is_inside(owner, m) for m in inner):
            continue
        for attr, param in owner.named_parameters(recurse=False):
            name = f"{prefix}.{attr}" if prefix else attr
            if hasattr(param, "_fsdp_replaced_by"):
                raise UsageError(f"parameter {name!r} is shared with an inner fully_shard unit"
                                 " (a weight tied across two units)",
                                 hint="fully_shard the module that holds both users of the"
                                      " weight, or untie it", same_on_every_rank=True)
            if param not in found:
                found[param] = (name, [])
            if (owner, attr) not in found[param][1]:
                found[param][1].append((owner, attr))
    return [(name, users, param) for param, (name, users) in found.items()]


def _is_inside(module, outer):
    return any(module is m for m in outer.modules())


def _refuse_stale_optimizers():
    """An optimizer built before fully_shard holds the replaced parameters: they never get a
    gradient again, and step() would silently do nothing. Refuse it at its first step."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_optimizer)


_hook = None


def _check_optimizer(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if hasattr(p, "_fsdp_replaced_by"):
                raise UsageError(
                    f"{type(optimizer).__name__} holds a parameter of shape {list(p.shape)} that"
                    " fully_shard replaced by its shard: this optimizer was built before sharding",
                    hint="call fully_shard first, then build the optimizer from"
                         " model.parameters()")


def _padded_rows(t, rows):
    """t with zero rows appended up to `rows` rows."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _tensors(obj):
    return [t for t in torch.utils._pytree.tree_leaves(obj) if torch.is_tensor(t)]


def _notify_when_done(unit, inputs):
    """inputs, with the tensors that need a gradient passed through _BackwardDone."""
    leaves, spec = torch.utils._pytree.tree_flatten(inputs)
    where = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
    if where:
        passed = _BackwardDone.apply(unit, *[leaves[i] for i in where])
        for i, t in zip(where, passed if len(where) > 1 else [passed]):
            leaves[i] = t
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _cast_floats(obj, dtype):
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)
