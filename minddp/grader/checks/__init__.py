"""The checks: one file per exercise, named after it, and CHECKS, every check by name.

    minddp grade exercises/naive.py      # ranks/world.py runs CHECKS["naive"] on every rank

A check is called on every rank as CHECKS[exercise](student, rank, world_size): it runs the
student's code and stock's on the same models and data, gathers what every rank saw, and
returns the same results on each: [{"check", "passed", "where", "diagnosis"}], the first
difference and what it means. In the exercises' order (an exercise's other parts indented):
    sampler.py                  ShardSampler against DistributedSampler: every index
    broadcast.py                broadcast_parameters against rank src's own tensors
    naive.py                    NaiveDDP beside stock DDP (shared/data_parallel.py)
    bucketed.py                 BucketedDDP beside stock DDP, and the order buckets launch in
    zero.py                     ShardedOptimizer against ZeroRedundancyOptimizer
    fsdp.py                     fully_shard against stock's: whole gradients and weights
    tp.py                       the column and row splits against parallelize_module's
    pp.py                       one_f_one_b against the order stock's Schedule1F1B runs
    interleaved.py              interleaved_1f1b against stock's interleaved schedules' lists
    zero_bubble.py              add_bubbles against stock's pass, every slot
    ring.py                     ring_reduce_scatter against gloo's all_reduce, reduce_scatter
      ring_verdict.py           gloo's bits, or correct within any order's bound, or what's off
    recompute.py                checkpoint against torch.utils.checkpoint
      recompute_runs.py         the models and cases, one forward and backward recorded
    mesh.py                     grid_groups, grid_coordinate, init_device_mesh against stock's
    experts.py                  experts on ranks beside one process on the whole batch
      experts_reference.py      the one process, as each rank computes it
      experts_routing.py        every all_to_all's splits checked; a routing mistake named
      experts_verdict.py        the comparison, in the order the layer runs
    clip.py                     clip_grad_norm_ on a mesh against torchtitan's on stock's
      clip_verdict.py           the usual mistakes' totals, and the verdict
    ring_attention.py           the ring against stock's private ring
      ring_attention_blocks.py  chunk_ids and part_of_block against the positions alone
"""

# (each file imports stock's references at its top, so that importing this one, as a rank
# does before its group exists, imports them all: see ranks/world.py)
from . import (broadcast, bucketed, clip, experts, fsdp, interleaved, mesh, naive, pp,
               recompute, ring, ring_attention, sampler, tp, zero, zero_bubble)

CHECKS = {"sampler": sampler.sampler, "broadcast": broadcast.broadcast, "naive": naive.naive,
          "bucketed": bucketed.bucketed, "zero": zero.zero, "fsdp": fsdp.fsdp, "tp": tp.tp,
          "pp": pp.pp, "interleaved": interleaved.interleaved,
          "zero_bubble": zero_bubble.zero_bubble, "ring": ring.ring,
          "recompute": recompute.recompute, "mesh": mesh.mesh, "experts": experts.experts,
          "clip": clip.clip, "ring_attention": ring_attention.ring_attention}
