"""FSDP's bookkeeping (shard.py): what one parameter holds, and which unit a module is.

    pytest tests/test_fsdp.py

A module computes with whatever tensor sits in its `_parameters` slot. Between uses that is
the shard, this rank's block of rows (what the optimizer updates); while the unit runs it is
the whole weight, gathered into a tensor whose storage is freed again afterwards. `Param.show`
swaps one for the other in every module that uses the parameter. `unit_of(module)` is how
the drop-in, the tools and the benchmarks find the Unit that fully_shard made of a module.
"""

from dataclasses import dataclass

import torch


@dataclass
class Param:
    """One sharded parameter of a Unit (stock's FSDPParam, in a few fields)."""

    name: str  # its name in the unit's module ("0.weight")
    users: list  # [(module, attribute)]: where the module tree holds it
    shard: torch.nn.Parameter  # this rank's block of rows, a DTensor (what the optimizer sees)
    full: torch.nn.Parameter  # the whole weight, its storage there only while gathered
    rows: int  # rows per block: dim 0 / world_size, rounded up (the last blocks padded)
    block_numel: int  # elements per block, padding included

    def show(self, tensor):
        """Every module that holds this parameter now holds `tensor` (the shard or the whole)."""
        for module, attr in self.users:
            module._parameters[attr] = tensor


def attach_unit(module, unit):
    """Make `unit` module's (a drop-in's Unit too): the one unit_of(module) returns."""
    module._fsdp_unit = unit
    return module


def unit_of(module):
    """The Unit fully_shard made of `module`, or None."""
    return getattr(module, "_fsdp_unit", None)


def owned_by(module, inner):
    """(name, [(module, attribute)], parameter) for `module`'s parameters outside the modules
    `inner` (the inner units' modules: each holds its own)."""
    return [(f"{prefix}.{attr}".lstrip("."), [(owner, attr)], param)
            for prefix, owner in module.named_modules()
            if not any(owner is m for unit in inner for m in unit.modules())
            for attr, param in owner.named_parameters(recurse=False)]
