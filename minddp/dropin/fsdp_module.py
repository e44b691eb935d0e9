"""FSDPModule: what `minddp.fully_shard(module)` turns `module` into, with stock's module API.

    pytest tests/test_fsdp_example.py   # PyTorch's FSDP2 example, stock's import swapped

Stock's fully_shard swaps the module's class for `FSDP<Class>`, a subclass of both
`torch.distributed.fsdp.FSDPModule` and the module's own class; code written for stock checks
`isinstance(model, FSDPModule)` and calls its methods. minddp does the same, so those checks
pass, and implements the methods on the lesson's Unit (`unit_of(module)`, fsdp/param.py):
  unshard / reshard                     the lesson's all_gather and free, one unit, on demand
  set_modules_to_forward_prefetch       when a unit's forward (backward) starts, gather the
  set_modules_to_backward_prefetch      listed units' too, on a thread (fsdp_prefetch.py)
  set_requires_gradient_sync            accumulate whole gradients, reduce on the synced step
  set_reshard_after_forward / _backward the lesson's reshard_after_forward; keep the weights
  set_is_last_backward                  accepted: minddp's reductions finish in backward
Every other method of stock's FSDPModule raises UsageError naming it: never a silent no-op.
"""

from torch.distributed.fsdp import FSDPModule as StockFSDPModule

from ..launch.usage_error import UsageError
from ..fsdp.param import unit_of
from .fsdp_prefetch import wait_for_prefetches


class FSDPModule(StockFSDPModule):
    """The methods stock's FSDPModule offers, on minddp's fully_shard units."""

    # Stock's __new__ rebuilds the original class (e.g. when a container is indexed): it is
    # found at this index of the MRO [FSDP<Class>, FSDPModule, stock FSDPModule, Class, ...].
    _orig_cls_mro_index = 3

    def unshard(self, async_op=False):
        """Collective: all_gather this module's own parameters (not recursive), as stock."""
        unit_of(self).unshard(async_op=async_op)  # async: on the prefetch thread
        return UnshardHandle() if async_op else None

    def reshard(self):
        """Free this module's whole weights; its parameters are the shards again."""
        unit_of(self).reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: backward keeps each whole gradient (summed over the backwards, in the
        reduce dtype) and reduces nothing; the next backward with True reduces the sum."""
        for unit in _units(self, recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        for unit in _units(self, recurse):
            unit.reshard_after_forward = _refuse_int(reshard_after_forward,
                                                     "set_reshard_after_forward")

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False: the whole weights stay gathered after backward (for gradient accumulation:
        the next forward needs no all_gather). Call reshard() before the optimizer steps."""
        for unit in _units(self, recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules):
        unit_of(self).forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules):
        unit_of(self).backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_is_last_backward(self, is_last_backward):
        """Accepted; nothing to do: stock waits here for reductions still in flight, and
        minddp's reduce_scatter has finished when each unit's backward ends."""

    def _get_fsdp_state(self):
        raise UsageError("this is minddp's fully_shard: stock FSDP's internal state"
                         " (_get_fsdp_state) does not exist here",
                         hint="use FSDPModule's public methods, or stock's fully_shard")

    def _apply(self, *args, **kwargs):
        # to_empty(), to(), cuda(): nn.Module replaces the registered parameters (the shards)
        # in place; the whole weights are not registered, so the unit re-makes them after.
        self.reshard()
        result = super(StockFSDPModule, self)._apply(*args, **kwargs)  # (nn.Module's)
        unit_of(self).adopt_registered_shards()
        return result


class UnshardHandle:
    """What unshard(async_op=True) returns: wait() for the all_gather (the module's forward
    waits for it anyway)."""

    def wait(self):
        wait_for_prefetches()


def _refusal(name):
    def refuse(self, *args, **kwargs):
        raise UsageError(f"FSDPModule.{name} is not implemented in minddp's fully_shard",
                         hint="use stock's fully_shard for it (from torch.distributed.fsdp"
                              " import fully_shard); docs/fsdp.md lists what minddp has")
    refuse.__name__ = name
    return refuse


for _name in dir(StockFSDPModule):  # every public method stock has and minddp does not
    if not _name.startswith("_") and _name not in vars(FSDPModule):
        setattr(FSDPModule, _name, _refusal(_name))

_classes = {}


def as_fsdp_module(module):
    """Make `module` an instance of FSDP<its class>, a subclass of FSDPModule (as stock does)."""
    cls = type(module)
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                             {"__deepcopy__": _no_deepcopy})
    module.__class__ = _classes[cls]
    return module


def _no_deepcopy(self, memo):
    raise UsageError("a module after fully_shard cannot be deep-copied (its parameters are"
                     " this rank's shards)", hint="deepcopy the model before fully_shard,"
                     " or save and load a state_dict")


def _units(module, recurse):
    modules = module.modules() if recurse else [module]
    return [unit_of(m) for m in modules if isinstance(m, FSDPModule)]


def _units_of(modules, method):
    for m in modules:
        if not isinstance(m, FSDPModule) or unit_of(m) is None:
            raise UsageError(f"{method} got a {type(m).__name__} that minddp's fully_shard"
                             " did not shard", hint="pass modules given to minddp.fully_shard")
    return [unit_of(m) for m in modules]


def _refuse_int(value, method):
    if not isinstance(value, bool):
        raise UsageError(f"{method}({value!r}): minddp reshards to the whole mesh or not at all",
                         hint="pass True or False (an int, resharding to a smaller mesh, is"
                              " stock's only)")
    return value

