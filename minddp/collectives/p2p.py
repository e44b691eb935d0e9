"""Send and receive at once: the one move every collective of this chapter is made of.

    pytest tests/test_collectives.py      # every collective built on it, bit for bit gloo's

gloo's send waits until the peer has posted the matching receive (a send that nobody
receives times out: `examples/break_collectives.py --break lost-send`). So a ring step in
which every rank first sends and then receives, with blocking calls, never gets going: each
rank waits in its send for a neighbour that is itself waiting in a send. exchange() posts
all of one step's sends and receives first (isend and irecv return at once), then waits for
all of them: the step completes whatever order the ranks reach it in.

Two numbers per rank (groups.py): the algorithms count in group ranks, 0 .. W-1, and
send/recv take global ranks, converted on the last line before a message leaves.
"""

import torch
import torch.distributed as dist

from ..launch.groups import global_rank, members
from ..launch.usage_error import UsageError

# Every message of this chapter carries this tag. gloo matches a receive to the first send
# from that rank with the same tag, so another sender on the same group (pp/stage.py's stages,
# ring.py's blocks) can never take one of these messages, nor these one of theirs.
TAG = 60


def exchange(group, sends=(), receives=()):
    """Post one step's sends and receives, each (tensor, group rank), at once; wait for all."""
    ops = []
    for tensor, peer in sends:
        if tensor.numel():  # an empty block: both sides know its size, neither posts it
            ops.append(dist.P2POp(dist.isend, tensor, global_rank(group, peer), group, TAG))
    for tensor, peer in receives:
        if tensor.numel():
            ops.append(dist.P2POp(dist.irecv, tensor, global_rank(group, peer), group, TAG))
    if not ops:
        return
    for request in dist.batch_isend_irecv(ops):
        request.wait()  # raises gloo's "Timed out" when a peer never posts its side


def stand_ins(tensors):
    """What to receive into: each tensor, or where it is not contiguous (a receive writes
    bytes as they lie) a contiguous one of its shape, which land() copies into place."""
    return [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t in tensors]


def land(tensors, received):
    """Copy each stand-in of stand_ins() into the tensor it stood in for."""
    for tensor, stand_in in zip(tensors, received):
        if stand_in is not tensor:
            tensor.copy_(stand_in)


def rank_and_size(group):
    """This rank's group rank and the group's size: what every algorithm counts in."""
    return dist.get_rank(group), dist.get_world_size(group)


def group_rank(group, rank, what):
    """The group rank of global rank `rank` (stock's src= and dst= are global ranks)."""
    if group is None or group is dist.group.WORLD:
        return rank
    if rank not in members(group):
        raise UsageError(f"{what}: global rank {rank} is not in the group"
                         f" (its global ranks: {members(group)})",
                         hint="src= and dst= name a global rank, as in torch.distributed")
    return dist.get_group_rank(group, rank)
