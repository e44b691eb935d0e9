"""barrier: no rank leaves until every rank has arrived, in ceil(log2 W) rounds.

    pytest tests/test_collectives.py -k barrier    # nobody leaves before the last arrives

The dissemination barrier (Hensgen, Finkel, Manber 1988): in round k every rank sends a
one-byte token to the rank 2^k after it and waits for the token of the rank 2^k before it.
A token carries news of every rank its sender had heard from, so after round k a rank has
heard, directly or not, from the 2^(k+1) - 1 ranks before it; after ceil(log2 W) rounds,
from all of them. A rank leaves only once it has heard from everyone: nobody leaves early.
Each rank sends ceil(log2 W) bytes, against W - 1 messages for one rank that collects
everyone's arrival and then tells everyone to go.
"""

import torch

from ..launch.groups import is_member
from .p2p import exchange, rank_and_size
from .work import launch


def dissemination(group):
    """Collective: call on every rank. Return once every rank of the group has called it."""
    rank, size = rank_and_size(group)
    token, heard = torch.ones(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
    distance = 1
    while distance < size:
        exchange(group, sends=[(token, (rank + distance) % size)],
                 receives=[(heard, (rank - distance) % size)])
        distance *= 2


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """Block until every rank of the group has reached its barrier (device_ids, timeout:
    stock's, unused here: the group's timeout holds).

    Collective: call on every rank. Stock's signature (torch.distributed.barrier)."""
    if not is_member(group):
        return None
    return launch(dissemination, (group,), [], async_op)
