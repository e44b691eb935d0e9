"""The ring: every rank sends to the next and receives from the previous, without waiting.

    pytest tests/test_context.py      # ring attention (ring_attention.py) passes its blocks on so

Rank r of W sends to rank r + 1 and receives from rank r - 1 (mod W): after W - 1 such
steps every rank has seen every rank's tensor, each having sent and received W - 1 times,
never more than one neighbour's at once. isend and irecv return at once, so the rank
computes on the tensor it holds while the next one travels; wait() when it is needed.
"""

import torch
import torch.distributed as dist

from ..launch.groups import global_rank


class _InFlight:
    """A block on its way: wait() finishes the send and the receive, and gives what came."""

    def __init__(self, received, requests):
        self.received, self.requests = received, requests

    def wait(self):
        for request in self.requests:
            request.wait()
        return self.received


def pass_on(tensor, group, tag):
    """Collective over the ring: send `tensor` to the next rank, receive the previous rank's.

    Returns at once (isend, irecv); the caller computes meanwhile, then calls wait().
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:  # a ring of one: the next rank is this one
        return _InFlight(tensor, [])
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, global_rank(group, (rank + 1) % size), group, tag),
           dist.P2POp(dist.irecv, received, global_rank(group, (rank - 1) % size), group, tag)]
    return _InFlight(received, dist.batch_isend_irecv(ops))
