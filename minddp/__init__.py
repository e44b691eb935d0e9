"""minddp: distributed data parallel training built by hand, beside stock DDP.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py

The reading order, with each file's size, is the table in README.md. Importing minddp
needs no process group, so the sampler and `python -m minddp.diff` work in a plain shell.
"""

from .broadcast import broadcast_parameters, check_same_model
from .bucketed import BucketedDDP
from .checkpoint import load_checkpoint, save_checkpoint
from .ddp import ManualDDP
from .errors import UsageError, exit_on_failure, exit_on_usage_error
from .gradtable import GradTable
from .launch import DDPEnv, ddp_setup, ddp_teardown, print0, print_rank
from .naive import NaiveDDP
from .replicas import ReplicaError, check_replicas
from .sampler import ShardSampler, check_batches
from .toy import NeuralNetwork, ToyDataset, all_reduce_accuracy, compute_accuracy, toy_datasets
from .workarounds import import_dynamo_first
from .zero import ShardedOptimizer

# A group created before torch._dynamo is imported outlives destroy_process_group()
# (workarounds.py). Training code that builds its own group (init_process_group, not
# ddp_setup) imports minddp first, so importing it here covers that code too.
import_dynamo_first()

__all__ = [
    "NaiveDDP", "BucketedDDP", "ManualDDP", "ShardSampler", "check_batches",
    "broadcast_parameters", "check_same_model", "DDPEnv", "ddp_setup", "ddp_teardown",
    "print0", "print_rank", "GradTable", "check_replicas", "ReplicaError", "ShardedOptimizer",
    "load_checkpoint", "save_checkpoint", "UsageError", "exit_on_usage_error",
    "exit_on_failure", "NeuralNetwork", "ToyDataset", "toy_datasets", "all_reduce_accuracy",
    "compute_accuracy",
]
