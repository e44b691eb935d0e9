"""Stock's pipeline schedules on torch 2.11 and 2.12, with the two fixes 2.13 made to them.

    bash .ci/other-torch 2.11.0 tests/test_pp_interleaved.py   # stock's V on gloo, bitwise

minddp's pipelines are compared with stock's bit for bit (examples, benchmarks, tests).
Before 2.13, a stock schedule's first step does two things 2.13 no longer does:
  shapes     each stage runs its forward once, on zeros, to learn its output's shape,
             drawing from the global random generator: every dropout mask after it is
             another than minddp's (and than 2.13's, which forks the generator around it)
  warm-up    each stage sends a number to its neighbour stages, the two stages at a
             V's turn (stages p-1 and p, both on rank p-1) included: a send to itself,
             which gloo refuses ("Pair is not connected"), so ZBV and DualPipeV fail
Importing this file gives 2.11's stages 2.13's behaviour in both; the steps themselves
are untouched. On 2.13 and later it does nothing. Imported wherever stock's stages are
built beside minddp's: tests/helpers.py, references/libraries.py, bench/pp.py, the examples.
"""

import torch
import torch.distributed as dist

OLDER = torch.__version__ < "2.13"


def stock_stages_as_in_2_13():
    """Patch stock's PipelineStage (torch < 2.13): shape inference in a forked generator,
    no warm-up send to its own rank. Idempotent."""
    from torch.distributed.pipelining import stage as stock_stage
    base, stage = stock_stage._PipelineStageBase, stock_stage.PipelineStage
    if getattr(base, "_minddp_as_in_2_13", False):
        return
    warm_up = getattr(base, "_get_init_p2p_neighbors_ops", None)
    infer = getattr(stage, "_shape_inference", None)
    if warm_up is not None:
        def to_others(self):
            me = dist.get_rank(self.group)
            return [op for op in warm_up(self) if op.group_peer != me]
        base._get_init_p2p_neighbors_ops = to_others
    if infer is not None:
        def shapes_in_a_forked_generator(self, *args, **kwargs):
            device = torch.device(self.device)  # (the CPU generator is always forked)
            devices = [] if device.type == "cpu" else [device]
            with torch.random.fork_rng(devices=devices, device_type=device.type):
                return infer(self, *args, **kwargs)
        stage._shape_inference = shapes_in_a_forked_generator
    base._minddp_as_in_2_13 = True


if OLDER:
    stock_stages_as_in_2_13()
