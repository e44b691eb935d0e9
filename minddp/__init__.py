"""minddp: data parallel training built by hand from torch.distributed, beside stock PyTorch.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py
    minddp --help                         # every tool: diff, timeline, bench, ...

The files at this level are the lessons, each read top to bottom (`minddp lessons` gives
the order). Around them, four folders, each for one kind of reader:
    dropin/  stock's whole contract on top of the lessons, for real training code
    tools/   instruments: gradient tables, the diff, replicas, the timeline, pictures
    bench/   what each lesson costs, measured beside stock
    run/     what every example needs: flags, errors, the toy problem, checkpoints

`from minddp import NAME` takes the names below from the files that define them, when first
asked: importing minddp itself needs no process group and no torch (`minddp diff` starts in
a fraction of a second). The lessons import each other, never this file.
"""

import importlib

PUBLIC = {  # name -> the module that defines it
    "UsageError": "usage_error",
    "ShardSampler": "sampler", "check_batches": "sampler",
    "broadcast_parameters": "broadcast", "check_same_model": "broadcast",
    "DDPEnv": "launch", "ddp_setup": "launch", "ddp_teardown": "teardown", "print0": "launch",
    "print_rank": "launch",
    "NaiveDDP": "naive", "BucketedDDP": "bucketed", "ShardedOptimizer": "zero",
    "ring_attention": "context",
    "ManualDDP": "dropin.ddp", "fully_shard": "dropin.fsdp", "MixedPrecisionPolicy": "dropin.fsdp",
    "GradTable": "tools.gradtable", "check_replicas": "tools.replicas",
    "ReplicaError": "tools.replicas",
    "exit_on_usage_error": "run.errors", "exit_on_failure": "run.errors",
    "load_checkpoint": "run.checkpoint", "save_checkpoint": "run.checkpoint",
    "NeuralNetwork": "run.toy", "ToyDataset": "run.toy", "toy_datasets": "run.toy",
    "all_reduce_accuracy": "run.toy", "compute_accuracy": "run.toy",
}
__all__ = list(PUBLIC)


def __getattr__(name):
    if name not in PUBLIC:
        raise AttributeError(f"module 'minddp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{PUBLIC[name]}", __name__), name)


def __dir__():
    return sorted(list(globals()) + __all__)
