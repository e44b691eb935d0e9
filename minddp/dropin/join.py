"""Uneven inputs: ManualDDP.join(), a rank that ran out of batches shadows the others' collectives.

    torchrun --nproc_per_node=2 examples/break_ddp.py --break uneven   # the hang, bounded
    pytest tests/test_join.py                                          # bitwise against stock

Collectives pair up by the order they are issued. When one rank has a batch more than the
others, its next backward all-reduces buckets that nobody answers: it waits until the
process-group timeout (torch's default: 10 to 30 minutes). Stock DDP's answer, and this
one, is the Join context manager (torch.distributed.algorithms.Join): a rank that leaves
its loop enters Join.__exit__, which keeps answering the others, step by step, with the
same collectives in the same order, contributing zeros, until every rank is done.

One training step of a rank that still has data, in join mode (ManualDDP.forward):
  1. all_reduce(1), async: "I am still here" (Join.notify_join_context); its sum is the
     number of ranks still training, the divisor with divide_by_initial_world_size=False;
  2. the buckets' one-time rebuild (its broadcast), as without join;
  3. buffers: from the highest rank still training (all_reduce MAX, then broadcast),
     since rank 0 may have joined with stale statistics;
  4. all_reduce(1 if this backward syncs else 0): whether the joined ranks must shadow it;
  5. backward: the buckets' all_reduces.
A joined rank answers each with the same call: 0 for 1., the same broadcast for 2., -1 for
3., 0 for 4. (reading the sum), and all-reduced zeros, bucket by bucket, for 5. At the end
every rank takes the weights of the highest rank among the last to finish. This is stock's
protocol (torch/nn/parallel/distributed.py: _DDPJoinHook), collective for collective.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, Joinable

from ..ddp.broadcast import broadcast_parameters
from ..launch.groups import global_rank
from ..launch.usage_error import UsageError


class ManualJoinHook(JoinHook):
    """What a joined rank does for each step the others still take, and at the very end."""

    def __init__(self, ddp, divide_by_initial_world_size):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self):
        ddp = self.ddp
        ddp._rebuild_buckets()  # 2.: answers the rebuild's broadcast, if the others rebuild now
        if ddp.require_forward_param_sync and ddp.broadcast_buffers and _buffers(ddp):
            sync_buffers(ddp, still_training=False)  # 3.
        flag = torch.zeros(1, device=ddp.join_device)  # 4.: will the others sync this step?
        dist.all_reduce(flag, group=ddp.process_group)
        ddp.require_forward_param_sync = should_sync = flag.item() != 0
        if should_sync:  # 5.: zeros for every bucket, in bucket order, as the others launch them
            works = [dist.all_reduce(torch.zeros_like(b.flat), group=ddp.process_group,
                                     async_op=True) for b in ddp.buckets]
            for work in works:
                work.wait()

    def post_hook(self, is_last_joiner):
        # Everyone agrees on one copy: the highest rank among those that finished last.
        ddp = self.ddp
        src = common_rank(ddp, dist.get_rank(ddp.process_group) if is_last_joiner else -1)
        broadcast_parameters(ddp.module, src=src, group=ddp.process_group,  # a group rank
                             buffers=ddp.broadcast_buffers)


def join_forward(ddp):
    """Steps 1-4 for a rank that still has data; returns the work of step 1 (the count)."""
    work = Join.notify_join_context(ddp)  # 1. (and the early-termination check)
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        ddp._rebuild_buckets()  # 2.
    if ddp.require_forward_param_sync and ddp.broadcast_buffers and _buffers(ddp):
        sync_buffers(ddp, still_training=True)  # 3.
    flag = torch.full((1,), float(ddp.require_backward_grad_sync), device=ddp.join_device)
    dist.all_reduce(flag, group=ddp.process_group, async_op=True)  # 4.: nobody waits for it
    return work


def sync_buffers(ddp, still_training):
    src = common_rank(ddp, dist.get_rank(ddp.process_group) if still_training else -1)
    with torch.no_grad():
        for buffer in _buffers(ddp):
            dist.broadcast(buffer, src=global_rank(ddp.process_group, src),
                           group=ddp.process_group)


def common_rank(ddp, candidate):
    """Collective: the highest candidate rank (-1: not a candidate), the same on every rank."""
    rank = torch.tensor([candidate], device=ddp.join_device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    return int(rank.item())


def check_joinable(ddp):
    if ddp.find_unused_parameters or ddp._comm_hook is not None:
        knob = "find_unused_parameters=True" if ddp.find_unused_parameters else "a comm hook"
        raise UsageError(f"ManualDDP.join() with {knob} is not implemented",
                         hint="use join() with the default knobs, or stock DDP's join()")


def _buffers(ddp):
    return [b for _, b in ddp.module.named_buffers()]


class JoinableDDP(Joinable):
    """ManualDDP's join() and what torch's Join needs of it (the Joinable interface)."""

    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """Context manager for ranks with different numbers of batches, stock's join().

        Collective: call on every rank. A rank that runs out shadows the others' steps.
        """
        check_joinable(self)
        return Join([self], enable, throw_on_early_termination,
                     divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """What this rank does once joined (Joinable's interface): join.ManualJoinHook."""
        return ManualJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self._params[0].device

    @property
    def join_process_group(self):
        return self.process_group or dist.group.WORLD

    def _divisor(self):
        """world_size, or in join mode, maybe the number of ranks still training (step 1)."""
        if self._still_training is None or self._divide_by_initial_world_size:
            return self.world_size
        if isinstance(self._still_training, dist.Work):  # step 1's sum, read once per step
            self._still_training.wait()
            self._still_training = int(self._still_training.result()[0].item())
        return self._still_training

