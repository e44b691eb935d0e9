"""minddp: data parallel training built by hand from torch.distributed, beside stock PyTorch.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py
    minddp --help                         # every tool: diff, timeline, bench, ...

The folders at this level are the course's chapters, in the reading order (`minddp lessons`):
    launch/ collectives/ ddp/ zero/ fsdp/ tp/ pp/ elastic/ mesh/ memory/ cp/ ep/ invariant/
each a folder of lessons read top to bottom, its __init__.py the chapter's first page.
Around them, eight folders, each for one kind of reader:
    dropin/      stock's whole contract on top of the lessons, for real training code
    references/  what a lesson is proved against where stock has no public twin
    grader/      exercises made from the lessons, a student's file graded beside stock
    tools/       instruments: gradient tables, the diff, replicas, the timeline, pictures
    bench/       what each lesson costs, measured beside stock
    run/         what every example needs: flags, errors, the toy problem, checkpoints
    site/        the course as a web site: each lesson beside its comments, the docs, search
    fuzz/        models and meshes drawn at random, each in invariant mode beside one process

`from minddp import NAME` takes the names below from the files that define them, when first
asked: importing minddp itself needs no process group and no torch (`minddp diff` starts in
a fraction of a second). The lessons import each other, never this file.
"""

import importlib

PUBLIC = {  # name -> the module that defines it
    "UsageError": "launch.usage_error",
    "ShardSampler": "ddp.sampler", "check_batches": "ddp.sampler",
    "broadcast_parameters": "ddp.broadcast", "check_same_model": "ddp.broadcast",
    "DDPEnv": "launch.start", "ddp_setup": "launch.start", "ddp_teardown": "launch.teardown",
    "print0": "launch.start", "print_rank": "launch.start",
    "NaiveDDP": "ddp.naive", "BucketedDDP": "ddp.bucketed", "ShardedOptimizer": "zero.optimizer",
    "ring_attention": "cp.ring_attention",
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
