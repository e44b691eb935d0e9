"""Tensor and sequence parallelism: every rank a slice of each layer, not a copy.

    torchrun --nproc_per_node=2 examples/tp.py --grad-table runs/tp.txt
    torchrun --nproc_per_node=2 examples/tp.py --tp stock --grad-table runs/tp-stock.txt
    minddp diff runs/tp.txt runs/tp-stock.txt          # IDENTICAL
    pytest tests/test_tp.py                             # every rank bitwise equal to stock's

Megatron's split: a linear layer cut by columns needs no communication forward, one cut by
rows needs a sum; a column layer followed by a row layer costs one all_reduce. Sequence
parallelism cuts what tensor parallelism leaves whole (norms, dropout) along the sequence.
This package is minddp's torch.distributed.tensor.parallel: `from minddp.tp import
ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, parallelize_module`.
Read in this order:
    ops.py                the autograd Functions: each one's backward is another's forward
    parallel.py           ColwiseParallel, RowwiseParallel, parallelize_module
    sequence_parallel.py  SequenceParallel, PrepareModuleInput: the sequence cut
    plan.py               a plan read as stock reads it: names, wildcards, refusals
The examples: examples/tp.py, examples/break_tp.py. The docs page: docs/tp.md. The exercise:
minddp exercise tp DIR.
"""

from .parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from .sequence_parallel import PrepareModuleInput, SequenceParallel

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "parallelize_module"]
