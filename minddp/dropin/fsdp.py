"""minddp.fully_shard: the FSDP lesson with the rest of stock fully_shard's contract on top.

    pytest tests/test_fsdp.py      # each rank's shards equal stock fully_shard's, 1-4 ranks

Read fsdp.py first: shard, unshard, reshard, the hooks and the reduce_scatter are there, in
fp32, and nothing here changes them. This file adds what real code asks of stock's
fully_shard, each piece an override of one lesson method:
  mp_policy        MixedPrecisionPolicy (stock's four fields): whole weights gathered and
                   computed in param_dtype, gradients reduced in reduce_dtype, inputs and
                   outputs cast                                  (shard, reduce_scatter, hooks)
  tied weights     a weight two modules of one unit share is sharded once; a weight tied
                   across two units is refused, named                   (owned_parameters)
  checks           the same model on every rank (before any collective), one dtype per unit,
                   no scalar parameter, fully_shard once per module; an optimizer built
                   before sharding holds replaced parameters: refused at its first step
  torch versions   the lesson's collectives under their names before torch 2.13
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map_only

from .. import UsageError, fsdp
from ..broadcast import check_same_model

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


def fully_shard(module, *, reshard_after_forward=None, mp_policy=None, process_group=None):
    """Shard `module`'s parameters (those not in an inner unit) over the ranks; returns module.

    Collective: call on every rank. Inner blocks first, the root last; then build the optimizer.
    reshard_after_forward: free the whole weights after forward (default: yes, but the root's
    are kept, as stock keeps them: its backward starts at once and would gather them again).
    """
    if hasattr(module, "_fsdp_unit"):
        raise UsageError(f"fully_shard was already applied to this {type(module).__name__}",
                         hint="call fully_shard once per module", same_on_every_rank=True)
    _refuse_stale_optimizers()
    module._fsdp_unit = Unit(module, reshard_after_forward, mp_policy or MixedPrecisionPolicy(),
                             process_group)
    return module


class Unit(fsdp.Unit):
    """fsdp.Unit with mixed precision, tied weights and stock's checks."""

    def __init__(self, module, reshard_after_forward, mp_policy, group):
        self.mp = mp_policy
        super().__init__(module, reshard_after_forward, group)

    def owned_parameters(self):
        found = {}  # parameter -> (name, its users): a tied weight is one parameter, two users
        for prefix, owner in self.module.named_modules(remove_duplicate=False):
            if any(owner is m for unit in self.inner for m in unit.module.modules()):
                continue
            for attr, param in owner.named_parameters(recurse=False):
                name = f"{prefix}.{attr}" if prefix else attr
                if hasattr(param, "_fsdp_replaced_by"):
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
        param._fsdp_replaced_by = p.shard  # an optimizer still holding `param` is told so
        if self.mp.param_dtype not in (None, param.dtype):  # gathered, computed in param_dtype
            p.full = torch.nn.Parameter(param.new_empty(param.shape, dtype=self.mp.param_dtype),
                                        param.requires_grad)
            p.full.untyped_storage().resize_(0)  # (allocated by each unshard, as in the lesson)
        return p

    def _pre_forward(self, module, args, kwargs):
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        super()._pre_forward(module, args, kwargs)  # the backward hook sees the cast inputs
        return args, kwargs

    def _post_forward(self, module, args, output):
        output = super()._post_forward(module, args, output)
        if self.mp.output_dtype is None:
            return output
        return _cast_floats(output, self.mp.output_dtype)

    def reduce_scatter(self, params, grads):
        # The cast commutes with the lesson's padding and concatenation: reduced in
        # reduce_dtype (default: the gradients' own), kept in the shard's dtype.
        dtype = self.mp.reduce_dtype or grads[0].dtype
        blocks = super().reduce_scatter(params, [g.to(dtype) for g in grads])
        return [block.to(p.shard.dtype) for p, block in zip(params, blocks)]


def _cast_floats(obj, dtype):
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


_hook = None


def _refuse_stale_optimizers():
    """An optimizer built before fully_shard holds the replaced parameters: they never get a
    gradient again, and step() would silently do nothing. Refuse it at its first step."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if hasattr(p, "_fsdp_replaced_by"):
                raise UsageError(
                    f"{type(optimizer).__name__} holds a parameter of shape {list(p.shape)} that"
                    " fully_shard replaced by its shard: this optimizer was built before sharding",
                    hint="call fully_shard first, then build the optimizer from"
                         " model.parameters()")
