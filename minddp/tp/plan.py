"""A tensor-parallel plan read as stock reads it: names, wildcards, and what is refused.

    pytest tests/test_tp.py -k plan

`parallelize_module(model, mesh, plan)` (parallel.py) takes stock's plans: a dict from module
names to styles, or one style for the whole model. Before any collective, this file turns
the plan into {module name: style} and checks it, so a wrong plan is one line on every rank:
  names       "mlp.up" names a submodule; each dot-separated part may be a wildcard, matched
              against the children's names (fnmatch), as stock matches them: "layers.*.mlp"
              names that MLP in every layer; "" (or a style alone) is the model itself
  checks      a name that matches nothing, a style on something that is not an nn.Linear, a
              split the world size does not divide, heads that do not split whole, a model
              already wrapped for data parallelism
  refusals    stock's arguments that minddp does not implement, each named with what stock
              does with it (docs/tp.md lists them)
"""

import weakref
from fnmatch import fnmatch

import torch.distributed as dist
from torch import nn

from ..launch.usage_error import UsageError
from ..fsdp.param import unit_of

SLICES = weakref.WeakKeyDictionary()  # module -> {attribute: (dim, group)}: tp.keep_slice's


def resolve_plan(module, plan):
    """{module name: style}, in the plan's order, every wildcard expanded as stock does."""
    if plan is None:
        return {}
    if not isinstance(plan, dict):
        return {"": plan}  # one style: applied to the model itself
    resolved = {}
    for key, style in plan.items():
        names = _matches(module, key.split(".") if key else [], "")
        if not names:
            raise UsageError(f"the plan names {key!r}, which {type(module).__name__} does not"
                             f" have", same_on_every_rank=True,
                             hint="use the names of model.named_modules(); stock warns and"
                                  " skips such a key")
        resolved.update((name, style) for name in names)
    return resolved


def _matches(module, parts, prefix=""):
    """The names of module's descendants that `parts` match, one part per level."""
    if not parts:
        return [prefix]
    return [name for child_name, child in module.named_children() if fnmatch(child_name, parts[0])
            for name in _matches(child, parts[1:], f"{prefix}.{child_name}".lstrip("."))]


def check_plan(module, plan, group):
    """Refuse, in one line on every rank, a plan that cannot be applied; before any collective."""
    modules = dict(module.named_modules())
    if hasattr(module, "require_backward_grad_sync") or any(map(sharded, modules.values())):
        raise UsageError("parallelize_module on a model already wrapped for data parallelism"
                         " (DDP or fully_shard)", same_on_every_rank=True,
                         hint="split the plain model: parallel.py takes one group of ranks,"
                              " no 2-D mesh")
    for name, style in plan.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        style.check(name, modules[name], parent, dist.get_world_size(group))


def check_split(name, module, parent, dim, world_size):
    """A column (dim 0) or row (dim 1) split: of an nn.Linear, equal, whole heads."""
    if not isinstance(module, nn.Linear):
        raise UsageError(f"{name!r} is a {type(module).__name__}, not an nn.Linear",
                         hint="name Linear layers in the plan", same_on_every_rank=True)
    if module.weight.shape[dim] % world_size:
        raise UsageError(f"{name!r}: weight dimension {dim} has {module.weight.shape[dim]}"
                         f" entries, which {world_size} ranks cannot share equally",
                         hint="choose a size the world size divides", same_on_every_rank=True)
    heads = getattr(parent, "head_dim", None)  # an attention's q, k, v: whole heads per rank
    width = module.out_features // world_size
    if dim == 0 and heads and width % heads:
        raise UsageError(f"{name!r}: {width} output features per rank is not a whole number"
                         f" of heads of {heads}", same_on_every_rank=True,
                         hint="use a world size that divides the number of heads")


def sharded(module):
    """Is `module` a unit of stock's or minddp's fully_shard?"""
    from torch.distributed.fsdp import FSDPModule  # (here: it imports torch's DTensor)
    return isinstance(module, FSDPModule) or unit_of(module) is not None


def refuse_layouts(style, wanted, use_local_output, **layouts):
    """One line for a layout or use_local_output that minddp's splits do not implement."""
    for arg, layout in layouts.items():
        if layout is not None and getattr(layout, "dim", None) != -1:
            raise UsageError(f"{style}({arg}={layout!r}) is not implemented: minddp's {style}"
                             f" takes {arg}={wanted} only", same_on_every_rank=True,
                             hint=f"stock redistributes a DTensor to {wanted} there; leave"
                                  f" {arg} at its default")
    if use_local_output is not True:
        raise UsageError(f"{style}(use_local_output={use_local_output}) is not implemented:"
                         " minddp's splits hand on plain tensors", same_on_every_rank=True,
                         hint="stock would hand on a DTensor; leave use_local_output=True")


def refuse_prepare(layouts, desired, kwarg_layouts, use_local_output):
    """One line for a PrepareModuleInput that does anything but gather Shard(d) inputs."""
    desired = desired if isinstance(desired, (tuple, list)) else (desired,)
    pairs = list(zip(layouts, desired)) if len(desired) == len(layouts) else None
    ok = pairs is not None and all(
        (a is None and b is None) or (getattr(a, "dim", None) is not None
                                      and type(b).__name__ == "Replicate") for a, b in pairs)
    if not ok or kwarg_layouts or use_local_output:
        raise UsageError("PrepareModuleInput is implemented for input_layouts=Shard(d) ->"
                         " desired_input_layouts=Replicate() (None -> None: passed on), with"
                         " use_local_output=False and no kwarg layouts", same_on_every_rank=True,
                         hint="stock redistributes any DTensor layout; minddp gathers only")


def region_of(name, plan):
    """The innermost PrepareModuleInput of the plan whose module holds module `name`, or None."""
    outer = [r for r, style in plan.items() if hasattr(style, "gave")
             and (r == "" or name.startswith(r + "."))]
    return plan[max(outer, key=len)] if outer else None


def sliced(model):
    """{parameter name: (dim, group)} for the parameters of `model` that are TP slices: the
    whole is the ranks' slices concatenated along dim (what gradient tables gather)."""
    return {f"{prefix}.{attr}".lstrip("."): cut for prefix, m in model.named_modules()
            for attr, cut in SLICES.get(m, {}).items()}
