"""minddp: data parallel training built by hand from torch.distributed, beside stock PyTorch.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py
    minddp --help                         # every tool: diff, timeline, bench, ...

The files at this level are the lessons, each read top to bottom (README.md gives the
order). Around them, four folders, each for one kind of reader:
    dropin/  stock's whole contract on top of the lessons, for real training code
    tools/   instruments: gradient tables, the diff, replicas, the timeline, pictures
    bench/   what each lesson costs, measured beside stock
    run/     what every example needs: flags, errors, the toy problem, checkpoints

Importing minddp needs no process group and no torch: `minddp diff` starts in a fraction
of a second. A public name is imported from its file when first used (the table below);
editors and type checkers read the same imports in the `TYPE_CHECKING` block.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING


class UsageError(RuntimeError):
    """A mistake in how a run was set up: one line, and a hint on how to fix it.

    The one error type of the lessons. `same_on_every_rank=True` marks mistakes every rank
    detects alike (the data, the command line): only rank 0 prints them, not every rank.
    """

    def __init__(self, message, hint="", same_on_every_rank=False):
        """The mistake in one line; the hint says how to fix it."""
        super().__init__(message)
        self.message, self.hint, self.same_on_every_rank = message, hint, same_on_every_rank

    def __str__(self):
        return self.message + (f" (hint: {self.hint})" if self.hint else "")


_WHERE = {  # public name -> the module that defines it
    "ShardSampler": "sampler", "check_batches": "sampler",
    "broadcast_parameters": "broadcast", "check_same_model": "broadcast",
    "DDPEnv": "launch", "ddp_setup": "launch", "ddp_teardown": "launch", "print0": "launch",
    "print_rank": "launch",
    "NaiveDDP": "naive", "BucketedDDP": "bucketed", "ShardedOptimizer": "zero",
    "ManualDDP": "dropin.ddp", "fully_shard": "dropin.fsdp", "MixedPrecisionPolicy": "dropin.fsdp",
    "GradTable": "tools.gradtable", "check_replicas": "tools.replicas",
    "ReplicaError": "tools.replicas",
    "exit_on_usage_error": "run.errors", "exit_on_failure": "run.errors",
    "load_checkpoint": "run.checkpoint", "save_checkpoint": "run.checkpoint",
    "NeuralNetwork": "run.toy", "ToyDataset": "run.toy", "toy_datasets": "run.toy",
    "all_reduce_accuracy": "run.toy", "compute_accuracy": "run.toy",
}
__all__ = ["UsageError", *_WHERE]

if TYPE_CHECKING:  # what the table says, in the form editors follow to the definition
    from .broadcast import broadcast_parameters, check_same_model
    from .bucketed import BucketedDDP
    from .dropin.ddp import ManualDDP
    from .dropin.fsdp import MixedPrecisionPolicy, fully_shard
    from .launch import DDPEnv, ddp_setup, ddp_teardown, print0, print_rank
    from .naive import NaiveDDP
    from .run.checkpoint import load_checkpoint, save_checkpoint
    from .run.errors import exit_on_failure, exit_on_usage_error
    from .run.toy import (NeuralNetwork, ToyDataset, all_reduce_accuracy, compute_accuracy,
                          toy_datasets)
    from .sampler import ShardSampler, check_batches
    from .tools.gradtable import GradTable
    from .tools.replicas import ReplicaError, check_replicas
    from .zero import ShardedOptimizer


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'minddp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__():
    return sorted(list(globals()) + __all__)


# Modules that moved when the lessons got the top level to themselves: old imports and
# `minddp diff` (slides, scripts) still work, through the module's new place.
_MOVED = {
    "buckets": "bucket_layout", "ddp": "dropin.ddp", "compat": "dropin.checks",
    "join": "dropin.join", "unused": "dropin.unused", "hooks": "dropin.comm_hooks",
    "gradtable": "tools.gradtable", "diff": "tools.diff", "replicas": "tools.replicas",
    "timeline": "bench.timeline", "overlap": "tools.overlap", "pictures": "tools.pictures",
    "fsdp_state": "tools.whole_tensors", "zero_bench": "bench.zero",
    "fsdp_bench": "bench.fsdp", "cli": "run.cli", "errors": "run.errors",
    "workarounds": "launch", "checkpoint": "run.checkpoint", "faults": "run.faults",
    "toy": "run.toy",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import minddp.diff` is minddp.tools.diff itself; `minddp diff` runs it."""

    @staticmethod
    def _new(name):
        old = name.removeprefix(__name__ + ".")
        return f"{__name__}.{_MOVED[old]}" if old in _MOVED and old != name else None

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if self._new(name) else None

    def create_module(self, spec):
        module = importlib.import_module(self._new(spec.name))
        self._spec = module.__spec__  # the import system sets the alias's spec: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec  # the module ran at its new place already

    def get_code(self, name):  # what runpy asks for `python -m minddp.<old name>`
        return compile(f"import runpy\nrunpy.run_module({self._new(name)!r}, run_name='__main__',"
                       " alter_sys=True)", name, "exec")


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.append(_OldNames())  # last: only a name no file answers to reaches it
