"""Pipeline parallelism: each rank a stage of the layers, microbatches flowing through.

    torchrun --nproc_per_node=2 examples/pipeline.py --pp manual --schedule 1f1b
    pytest tests/test_pp.py tests/test_pp_interleaved.py  # losses, gradients, order: stock's
    minddp pp-schedules                                   # every schedule laid out

A stage sends its activations to the next rank and their gradients come back; a schedule is
the order in which each stage runs its forwards and backwards. Every schedule here is a list
of actions per stage, made by a function and run by one loop, and each list is stock's.
This package is minddp's torch.distributed.pipelining: `from minddp.pp import
PipelineStage, Schedule1F1B, ...`.
Read in this order:
    stage.py        PipelineStage: a stage's layers, its sends and receives
    schedules.py    the action lists and the one loop; GPipe and 1F1B
    interleaved.py  several stages per rank: interleaved 1F1B, looped BFS
    zero_bubble.py  the backward split into I and W, the Ws filling the bubble
    v_shaped.py     two stages per rank, down and back up: ZBV and DualPipeV
The examples: examples/pipeline.py, examples/break_pp.py. The docs page: docs/pp.md. The
exercise: minddp exercise pp DIR.
"""

from .interleaved import ScheduleInterleaved1F1B, ScheduleLoopedBFS
from .schedules import Schedule, Schedule1F1B, ScheduleGPipe, gpipe, one_f_one_b, sync_gradients
from .stage import PipelineStage, stage_layers
from .v_shaped import ScheduleDualPipeV, ScheduleZBVZeroBubble
from .zero_bubble import ScheduleInterleavedZeroBubble

__all__ = ["stage_layers", "PipelineStage", "Schedule", "ScheduleGPipe", "Schedule1F1B",
           "gpipe", "one_f_one_b", "sync_gradients", "ScheduleInterleaved1F1B",
           "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
           "ScheduleDualPipeV"]
