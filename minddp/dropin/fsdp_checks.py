"""What minddp.fully_shard refuses, each in one line on every rank, before it trains wrong.

    pytest tests/test_fsdp.py tests/test_fsdp_example.py   # each refusal, message by message

fully_shard (fsdp/shard.py) calls these first: stock's arguments minddp does not implement (a
shard_placement_fn, CPU offloading, a 3-D mesh, ...), and an optimizer built before sharding,
which holds the replaced parameters: they never get a gradient again, and its step() would
silently do nothing.
"""

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..launch.usage_error import UsageError


def refuse_stock_only(module, mesh, reshard_after_forward, stock_only):
    """One line for each stock argument minddp does not implement, before any collective."""
    unset = {"shard_placement_fn": None, "ignored_params": None, "dp_mesh_dims": None}
    for name, value in stock_only.items():
        if name == "offload_policy" and type(value).__name__ == "OffloadPolicy":
            continue  # stock's default: no offloading
        if name not in unset and name != "offload_policy":
            raise TypeError(f"fully_shard() got an unexpected keyword argument {name!r}")
        if value is not unset.get(name):
            raise UsageError(f"fully_shard({name}=...) is not implemented in minddp",
                             hint="use stock's fully_shard for it", same_on_every_rank=True)
    if isinstance(module, (list, tuple)):
        raise UsageError("fully_shard of a list of modules (one group for several) is not"
                         " implemented in minddp", hint="fully_shard each module, or a"
                         " module that holds them", same_on_every_rank=True)
    if mesh is not None and mesh.ndim not in (1, 2):
        raise UsageError(f"fully_shard on a {mesh.ndim}-D mesh: it takes a 1-D mesh (FSDP) or a"
                         " 2-D one (HSDP)", hint='pass the data-parallel dimensions, e.g.'
                         ' mesh["dp_replicate", "dp_shard"]', same_on_every_rank=True)
    if mesh is not None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise UsageError("fully_shard on a 2-D mesh (HSDP) without mesh_dim_names", hint=
                         "name its dimensions, as stock asks: init_device_mesh(...,"
                         ' mesh_dim_names=("dp_replicate", "dp_shard"))', same_on_every_rank=True)
    if not isinstance(reshard_after_forward, (bool, type(None))):
        raise UsageError(f"reshard_after_forward={reshard_after_forward!r}: minddp reshards"
                         " to the whole mesh or not at all", hint="pass True or False",
                         same_on_every_rank=True)


_hook = None


def refuse_stale_optimizers():
    """An optimizer built before fully_shard holds the replaced parameters: they never get a
    gradient again, and step() would silently do nothing. Refuse it at its first step."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if replaced_by(p) is not None:
                raise UsageError(
                    f"{type(optimizer).__name__} holds a parameter of shape {list(p.shape)} that"
                    " fully_shard replaced by its shard: this optimizer was built before sharding",
                    hint="call fully_shard first, then build the optimizer from"
                         " model.parameters()")


def mark_replaced(param, by):
    """`param` is no longer the model's: fully_shard put `by` in its place (see replaced_by)."""
    param._fsdp_replaced_by = by


def replaced_by(param):
    """What replaced `param` in the model (mark_replaced), or None if it is still the model's."""
    return getattr(param, "_fsdp_replaced_by", None)
