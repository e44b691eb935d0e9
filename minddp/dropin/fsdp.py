"""minddp.fully_shard: the FSDP lesson with the rest of stock fully_shard's contract on top.

    pytest tests/test_fsdp.py      # each rank's shards equal stock fully_shard's, 1-4 ranks

Read fsdp/shard.py first: shard, unshard, reshard, the hooks and the reduce_scatter are there, in
fp32, and nothing here changes them. This file adds what real code asks of stock's
fully_shard, each piece an override of one lesson method:
  mp_policy        MixedPrecisionPolicy (stock's four fields): whole weights gathered and
                   computed in param_dtype, gradients reduced in reduce_dtype, inputs and
                   outputs cast                                  (shard, reduce_scatter, hooks)
  tied weights     a weight two modules of one unit share is sharded once; a weight tied
                   across two units is refused, named                   (owned_parameters)
  checks           the same model on every rank (before any collective), one dtype per unit,
                   no scalar parameter, fully_shard once per module; stock-only arguments and
                   an optimizer built before sharding: fsdp_checks.py
  meta device      a model built under torch.device("meta") is sharded without values;
                   to_empty() and its init then give the shards values (adopt_registered_shards)
  checkpointing    a unit's forward run again inside backward (torch.utils.checkpoint) gathers
                   and keeps its weights: it neither frees them nor hooks a second backward
  module API       the module becomes an FSDPModule (fsdp_module.py): unshard(), reshard(),
                   prefetching, set_requires_gradient_sync, ...          (hooks, post_backward)
  torch versions   the lesson's collectives under their names before torch 2.13
  a 2-D mesh       HSDP: sharded over dimension 1, replicated over dimension 0 (hsdp.py)
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ..fsdp import shard as fsdp
from ..launch.usage_error import UsageError
from ..fsdp.param import attach_unit, unit_of
from ..ddp.broadcast import check_same_model
from .fsdp_checks import mark_replaced, refuse_stale_optimizers, refuse_stock_only, replaced_by
from .fsdp_module import FSDPModule, as_fsdp_module
from .fsdp_prefetch import prefetch, wait_for_prefetches
from .hsdp import Hybrid
from .sp_order import leave_partial, summed_if_partial

# torch 2.13 names the collectives all_gather_single and reduce_scatter_single, as the
# lesson calls them; older releases have the same functions under their earlier names.
if not hasattr(dist, "all_gather_single"):
    dist.all_gather_single = dist.all_gather_into_tensor
if not hasattr(dist, "reduce_scatter_single"):
    dist.reduce_scatter_single = dist.reduce_scatter_tensor


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in param_dtype (gathered in it), reduce gradients in reduce_dtype (stock's names)."""
    param_dtype: torch.dtype = None
    reduce_dtype: torch.dtype = None
    output_dtype: torch.dtype = None
    cast_forward_inputs: bool = True


def fully_shard(module, *, mesh=None, reshard_after_forward=None, mp_policy=None,
                process_group=None, **stock_only):
    """Shard `module`'s parameters (those not in an inner unit) over the ranks; returns module,
    now an FSDPModule.

    Collective: call on every rank. Inner blocks first, the root last; then build the optimizer.
    mesh: a 1-D DeviceMesh (or process_group); default: every rank. A 2-D mesh: HSDP.
    reshard_after_forward: free the whole weights after forward (default: yes, but the root's
    are kept, as stock keeps them: its backward starts at once and would gather them again).
    """
    refuse_stock_only(module, mesh, reshard_after_forward, stock_only)
    if isinstance(module, FSDPModule) or unit_of(module) is not None:
        raise UsageError(f"fully_shard was already applied to this {type(module).__name__}",
                         hint="call fully_shard once per module", same_on_every_rank=True)
    refuse_stale_optimizers()
    leave_partial(module)  # sequence parallel's gradients: summed over tp at the reduce
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if mesh is not None and mesh.ndim == 2:  # replicated over dim 0, sharded over dim 1
        unit = HybridUnit(module, reshard_after_forward, mp_policy, mesh)
    else:
        group = mesh.get_group() if mesh is not None else process_group
        unit = Unit(module, reshard_after_forward, mp_policy, group)
    attach_unit(module, unit)
    return as_fsdp_module(module)


class Unit(fsdp.Unit):
    """fsdp.Unit with mixed precision, tied weights and stock's checks."""

    def __init__(self, module, reshard_after_forward, mp_policy, group):
        self.mp = mp_policy
        self.requires_gradient_sync, self.reshard_after_backward = True, True
        self.forward_prefetch, self.backward_prefetch, self._holding = [], [], False
        super().__init__(module, reshard_after_forward, group)

    def owned_parameters(self):
        found = {}  # parameter -> (name, its users): a tied weight is one parameter, two users
        for prefix, owner in self.module.named_modules(remove_duplicate=False):
            if any(owner is m for unit in self.inner for m in unit.module.modules()):
                continue
            for attr, param in owner.named_parameters(recurse=False):
                name = f"{prefix}.{attr}" if prefix else attr
                if replaced_by(param) is not None:
                    raise UsageError(f"parameter {name!r} is shared with an inner fully_shard"
                                     " unit (a weight tied across two units)",
                                     hint="fully_shard the module that holds both users of the"
                                          " weight, or untie it", same_on_every_rank=True)
                if param.dim() == 0:
                    raise UsageError(f"parameter {name!r} is a scalar: FSDP shards along dim 0",
                                     hint="make it a 1-element vector", same_on_every_rank=True)
                users = found.setdefault(param, (name, []))[1]
                if (owner, attr) not in users:
                    users.append((owner, attr))
        owners = [(name, users, param) for param, (name, users) in found.items()]
        # Before any collective: ranks whose models differ would pair up wrong collectives.
        check_same_model(self.module, self.group, tensors=[(n, p) for n, _, p in owners])
        dtypes = {self.mp.param_dtype or p.dtype for _, _, p in owners}
        if len(dtypes) > 1:  # one flat buffer per unit holds one dtype
            raise UsageError(f"the {type(self.module).__name__} given to fully_shard mixes"
                             f" parameter dtypes {sorted(map(str, dtypes))}",
                             same_on_every_rank=True,
                             hint="fully_shard the submodules of each dtype as units of their"
                                  " own, or set mp_policy=MixedPrecisionPolicy(param_dtype=...)")
        return owners

    @torch.no_grad()
    def shard(self, name, users, param):
        p = super().shard(name, users, param)
        mark_replaced(param, p.shard)  # an optimizer still holding `param` is told so
        if self.mp.param_dtype not in (None, param.dtype):  # gathered, computed in param_dtype
            p.full = torch.nn.Parameter(param.new_empty(param.shape, dtype=self.mp.param_dtype),
                                        param.requires_grad)
            p.full.untyped_storage().resize_(0)  # (allocated by each unshard, as in the lesson)
        return p

    def _pre_forward(self, module, args, kwargs):
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        if _in_backward():  # activation checkpointing recomputes this unit's forward
            self.unshard()
            if torch.is_grad_enabled():  # (reentrant: the first forward ran without autograd)
                self._backward_done = False  # reduced at the end of backward
            return args, kwargs
        # (the node that reduces after backward sees the cast inputs)
        args, kwargs = super()._pre_forward(module, args, kwargs) or (args, kwargs)
        for unit in self.forward_prefetch:
            prefetch(unit)  # gathered while this unit computes
        return args, kwargs

    def _post_forward(self, module, args, output):
        if not _in_backward():  # a recomputation keeps the weights: backward needs them next
            output = super()._post_forward(module, args, output)
        if self.root is self:
            wait_for_prefetches()  # none left in flight between forward and backward
        if self.mp.output_dtype is None:
            return output
        return _cast_floats(output, self.mp.output_dtype)

    def _pre_backward(self, grad):
        first = not self._backward_done
        grad = super()._pre_backward(grad)  # this unit gathered first, then the prefetches
        if first:
            for unit in self.backward_prefetch:
                if not unit._backward_done:  # (one already reduced would keep stale weights)
                    prefetch(unit)
        return grad

    def unshard(self, async_op=False):
        if async_op:
            return prefetch(self)
        wait_for_prefetches()  # a collective of the main thread: after those asked before it
        self.adopt_registered_shards()
        super().unshard()

    def reshard(self):
        if not self._holding:
            wait_for_prefetches()  # (one still gathering this unit would undo the reshard)
            super().reshard()

    def post_backward(self):
        if self._backward_done:
            return
        if self.requires_gradient_sync:
            self._holding = not self.reshard_after_backward
            try:
                return super().post_backward()
            finally:
                self._holding = False
        self._backward_done = True  # no sync: keep the sum of the whole gradients, reduce later
        for p in self.params:
            if p.full.grad is not None:
                grad = p.full.grad.to(self.mp.reduce_dtype or p.full.grad.dtype)
                p.accumulated = grad if getattr(p, "accumulated", None) is None else \
                    p.accumulated.add_(grad)  # as stock: in the reduce dtype
                p.full.grad = None
        if self.reshard_after_backward:
            self.reshard()

    def _end_of_backward(self):
        super()._end_of_backward()
        wait_for_prefetches()
        for unit in self.units:  # a unit prefetched but never run must not keep its weights
            if unit.is_unsharded and unit.reshard_after_backward and unit is not self:
                unit.reshard()

    def reduce_scatter(self, params, grads):
        # The cast commutes with the lesson's padding and concatenation: reduced in
        # reduce_dtype (default: the gradients' own), kept in the shard's dtype.
        wait_for_prefetches()  # a collective of the main thread: after those asked before it
        dtype = self.mp.reduce_dtype or grads[0].dtype
        grads = [g.to(dtype) for g in grads]
        for i, p in enumerate(params):  # the backwards without sync, summed in
            if getattr(p, "accumulated", None) is not None:
                grads[i], p.accumulated = p.accumulated.add_(grads[i]), None
            grads[i] = summed_if_partial(p.full, grads[i])  # sequence parallel's, over tp
        blocks = super().reduce_scatter(params, grads)
        return [block.to(p.shard.dtype) for p, block in zip(params, blocks)]

    @torch.no_grad()
    def adopt_registered_shards(self):
        """Take as this unit's shards what the module holds now: to_empty(), to() and
        load_state_dict(assign=True) register new tensors (meta -> real ones, or loaded)."""
        if self.is_unsharded:
            return
        for p in self.params:
            owner, attr = p.users[0]
            held = owner._parameters[attr]
            if held is p.shard and held.device == p.full.device:
                continue
            if not isinstance(held, DTensor) or held.shape != p.full.shape:
                raise UsageError(f"parameter {p.name!r} of a fully_shard unit was replaced by a"
                                 f" {type(held).__name__} of shape {list(held.shape)}",
                                 hint="load a sharded state_dict (DTensors, e.g. from"
                                      " get_model_state_dict) or use set_model_state_dict")
            local = held.to_local()
            if held.device_mesh.device_type != local.device.type:  # built on meta, now real
                self.mesh = type(self.mesh).from_group(self.group or dist.group.WORLD,
                                                      local.device.type)
                held = self.as_dtensor(local, p.full)
            if held is not p.shard:
                mark_replaced(p.shard, held)
                p.shard = held if isinstance(held, torch.nn.Parameter) else \
                    torch.nn.Parameter(held, p.shard.requires_grad)
            dtype = self.mp.param_dtype or local.dtype
            p.full = torch.nn.Parameter(torch.empty(p.full.shape, dtype=dtype, device=local.device),
                                        p.shard.requires_grad)
            p.full.untyped_storage().resize_(0)
            p.show(p.shard)


class HybridUnit(Unit, Hybrid):
    """Unit on a 2-D mesh (HSDP). Python reads Unit's methods first; where they call super(),
    Hybrid's (hsdp.py) run, then the lesson's: shard, reduce_scatter on both dimensions."""


def _in_backward():
    """True inside autograd's backward: a forward run now is a checkpoint's recomputation."""
    return torch._C._current_graph_task_id() != -1


def _cast_floats(obj, dtype):
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)
