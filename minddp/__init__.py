"""minddp: distributed data parallel training built by hand, beside stock DDP.

    pip install -e ".[test]"
    torchrun --nproc_per_node=2 examples/manual_ddp.py

Read the source in this order (README.md gives the sizes): launch, sampler, broadcast,
ddp, buckets, gradtable, diff, checkpoint, errors, bench. Importing minddp needs no process
group, so the sampler and `python -m minddp.diff` work in a plain Python session.
"""

from .broadcast import broadcast_parameters, check_same_model
from .checkpoint import check_crash_step, crash_if_asked, load_checkpoint, save_checkpoint
from .ddp import ManualDDP
from .errors import UsageError, exit_on_usage_error
from .gradtable import GradTable
from .launch import DDPEnv, ddp_setup, ddp_teardown, print0, print_rank
from .sampler import ShardSampler, check_batches
from .toy import NeuralNetwork, ToyDataset, compute_accuracy, toy_datasets

__all__ = [
    "broadcast_parameters", "check_same_model", "check_crash_step", "crash_if_asked", "load_checkpoint",
    "save_checkpoint", "ManualDDP", "UsageError", "exit_on_usage_error", "GradTable",
    "DDPEnv", "ddp_setup", "ddp_teardown", "print0", "print_rank", "ShardSampler", "check_batches",
    "NeuralNetwork", "ToyDataset", "compute_accuracy", "toy_datasets",
]
