"""minddp: distributed data parallel training built by hand, beside stock DDP.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py

The reading order, with each file's size, is the table in README.md. Importing minddp
needs no process group, so the sampler and `python -m minddp.diff` work in a plain shell.
Each name below is imported from its file when first used, so `python -m minddp.diff`
does not pay for the DDP classes (whose import brings in torch._dynamo: compat.py).
"""

import importlib

_WHERE = {  # public name -> the file that defines it
    "NaiveDDP": "naive", "BucketedDDP": "bucketed", "ManualDDP": "ddp",
    "ShardSampler": "sampler", "check_batches": "sampler",
    "broadcast_parameters": "broadcast", "check_same_model": "broadcast",
    "DDPEnv": "launch", "ddp_setup": "launch", "ddp_teardown": "launch", "print0": "launch",
    "print_rank": "launch", "GradTable": "gradtable", "check_replicas": "replicas",
    "ReplicaError": "replicas", "ShardedOptimizer": "zero", "fully_shard": "fsdp",
    "MixedPrecisionPolicy": "fsdp", "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint", "UsageError": "errors", "exit_on_usage_error": "errors",
    "exit_on_failure": "errors", "NeuralNetwork": "toy", "ToyDataset": "toy",
    "toy_datasets": "toy", "all_reduce_accuracy": "toy", "compute_accuracy": "toy",
}
__all__ = list(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'minddp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__():
    return sorted(list(globals()) + __all__)
