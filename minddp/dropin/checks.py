"""Stock DDP's constructor, checked as stock checks it: what makes minddp's wrappers drop-ins.

    python -c "import minddp, inspect; print(inspect.signature(minddp.ManualDDP))"

Real training code writes `DDP(model, device_ids=[local_rank])`. Swap in a minddp class
and that line must still work, and a call that stock refuses must be refused the same
way (the same exception type and message), so nothing differs silently. Not part of the
lesson: ManualDDP (ddp.py) calls them before handing the module to BucketedDDP.
"""

import warnings

import torch

from ..launch.usage_error import UsageError
from ..launch import start as launch  # noqa: F401  (it imports torch._dynamo: see below)

# Training code imports its DDP class at the top, before it creates its process group
# (init_process_group). A group created before torch._dynamo is first imported outlives
# destroy_process_group() and may abort the exit (launch/start.py imports torch._dynamo first
# for this reason); importing it with the class covers code that sets up its own group.


def check_stock_arguments(module, device_ids=None, output_device=None):
    """Stock's checks of module, device_ids and output_device; returns the device_ids to use.

    On a CUDA module, device_ids=[i] means "this module lives on cuda:i": forward then moves
    its inputs there, as stock does. On a CPU module stock refuses device_ids, and so do we.
    """
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have"
                           " any parameter that requires a gradient.")
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in params):
        raise RuntimeError("Modules with uninitialized parameters can't be used with"
                           " `DistributedDataParallel`. Run a dummy forward pass to correctly"
                           " initialize the modules")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    types = {p.device.type for p in params}
    if len(types) != 1:
        raise ValueError("DistributedDataParallel's input module must be on the same type of"
                         f" devices, but input module parameters locate in {types}.")
    multi_device = len({p.device for p in params}) > 1
    if not device_ids or types == {"cpu"} or multi_device:
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with"
                " single-device/multiple-device GPU modules or CPU modules, but got device_ids"
                f" {device_ids}, output_device {output_device}, and module parameters"
                f" {set(p.device for p in params)}.")
        return None
    return [torch._utils._get_device_index(d, True) for d in device_ids]


# Stock arguments ManualDDP does not implement: a value other than the default is refused.
NOT_IMPLEMENTED = {
    # batched_grad_copy=True: stock copies gradients into buckets another way; measured,
    # its bits differ from the default's at 3 ranks from the first step.
    "batched_grad_copy": False,
    "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None,
    "mixed_precision": None, "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    # lazy_bucket_allocation=True (torch 2.15): stock then allocates each bucket when its
    # first gradient is ready and frees it after backward; untried here, so refused.
    "lazy_bucket_allocation": False,
}


def refuse_unimplemented(**given):
    """One clear line for a stock argument that minddp does not implement."""
    for name, value in given.items():
        if value is not NOT_IMPLEMENTED[name] and value != NOT_IMPLEMENTED[name]:
            raise UsageError(f"ManualDDP does not implement stock DDP's {name}={value!r}",
                             hint=f"leave {name} at its default ({NOT_IMPLEMENTED[name]!r}), or"
                                  " use torch.nn.parallel.DistributedDataParallel for it")


def group_of(process_group, device_mesh):
    """Stock's rule: a process group, or a 1-D device mesh (its one group), never both."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise UsageError("Cannot specify both process_group and device_mesh arguments.",
                         hint="pass one: device_mesh=mesh[\"dp\"] is that slice's group")
    if device_mesh.ndim != 1:
        raise UsageError(f"Only 1D device mesh is supported, but got {device_mesh}.",
                         hint="pass the data-parallel dimension's slice: device_mesh=mesh[\"dp\"]")
    return device_mesh.get_group(mesh_dim=0)


def warn_check_reduction(check_reduction):
    """Stock's FutureWarning for check_reduction=True (it steers nothing, in stock either)."""
    if check_reduction:
        # stacklevel 3: the warning names the line that built ManualDDP, as stock's does
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is"
                      " deprecated. Please avoid using it.", FutureWarning, stacklevel=3)
