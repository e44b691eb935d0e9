"""minddp: distributed data parallel training built by hand, beside stock DDP.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py

Read the source in this order (README.md gives the sizes): launch, sampler, broadcast,
naive, ddp, buckets, gradtable, diff, then checkpoint and the rest. Importing minddp needs
no process group, so the sampler and `python -m minddp.diff` work in a plain Python shell.
"""

from .broadcast import broadcast_parameters, check_same_model
from .checkpoint import load_checkpoint, save_checkpoint
from .ddp import ManualDDP
from .errors import UsageError, exit_on_usage_error
from .gradtable import GradTable
from .launch import DDPEnv, ddp_setup, ddp_teardown, print0, print_rank
from .naive import NaiveDDP
from .replicas import ReplicaError, check_replicas
from .sampler import ShardSampler, check_batches
from .zero import ShardedOptimizer
from .toy import NeuralNetwork, ToyDataset, all_reduce_accuracy, compute_accuracy, toy_datasets

__all__ = [
    "broadcast_parameters", "check_same_model", "load_checkpoint", "save_checkpoint",
    "ManualDDP", "NaiveDDP", "ShardedOptimizer", "ReplicaError", "check_replicas", "UsageError",
    "exit_on_usage_error", "GradTable",
    "DDPEnv", "ddp_setup", "ddp_teardown", "print0", "print_rank", "ShardSampler", "check_batches",
    "NeuralNetwork", "ToyDataset", "all_reduce_accuracy", "compute_accuracy", "toy_datasets",
]
