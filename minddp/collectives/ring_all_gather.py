"""all_gather: every rank's tensor copied to every rank, round a ring.

    pytest tests/test_collectives.py -k all_gather   # bit for bit dist.all_gather's

The ranks stand in a ring. In the first step each rank sends its own block to the rank
before it (rank - 1, gloo's direction) and receives the block of the rank after it; in
every further step it passes on the block it received last. After W - 1 steps every block
has been everywhere. Each rank sends W - 1 blocks, (W-1)/W of the gathered bytes, and no
link carries more than one block at a time: the cost does not grow with W, only the steps.
No arithmetic: every rank ends with the same bits as gloo's all_gather.
ring_all_gather() is also the second half of the ring all_reduce (ring_all_reduce.py).
"""

from ..launch.groups import is_member
from .checks import check_count, check_output, check_same_shape, check_tensor
from .p2p import exchange, land, rank_and_size, stand_ins
from .work import launch


def ring_all_gather(blocks, group):
    """Collective: call on every rank. Copy block b from rank b to all, round the ring.

    `blocks`: this rank's W tensors (views of one buffer, or separate), the same sizes on
    every rank; rank b's own blocks[b] is complete, the others are overwritten."""
    rank, size = rank_and_size(group)
    to, came_from = (rank - 1) % size, (rank + 1) % size
    for step in range(size - 1):
        # I pass on the block that arrived in the previous step (my own, at step 0) and
        # take the next one: block rank + step goes out, block rank + step + 1 comes in.
        exchange(group, sends=[(blocks[(rank + step) % size], to)],
                 receives=[(blocks[(rank + step + 1) % size], came_from)])


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Fill tensor_list[r] with group rank r's `tensor`, on every rank.

    Collective: call on every rank. Stock's signature (torch.distributed.all_gather)."""
    if not is_member(group):
        return None
    rank, size = rank_and_size(group)
    check_tensor(tensor, "all_gather")  # only read: any layout
    check_count("all_gather", len(tensor_list), size, "output tensors")
    for out in tensor_list:
        check_output(out, "all_gather")
        check_count("all_gather", tuple(out.shape), tuple(tensor.shape), "(an output's shape)")
    return launch(_all_gather, (list(tensor_list), tensor, group), tensor_list, async_op)


def _all_gather(tensor_list, tensor, group):
    rank, size = rank_and_size(group)
    check_same_shape(tensor, group, "all_gather")
    blocks = stand_ins(tensor_list)  # a non-contiguous output receives into a stand-in
    blocks[rank].copy_(tensor)
    ring_all_gather(blocks, group)
    land(tensor_list, blocks)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Write group rank r's input_tensor into output_tensor's r-th 1/W, on every rank.

    Collective: call on every rank. Stock's signature (dist.all_gather_into_tensor)."""
    if not is_member(group):
        return None
    rank, size = rank_and_size(group)
    check_tensor(input_tensor, "all_gather_into_tensor")
    check_output(output_tensor, "all_gather_into_tensor")
    check_count("all_gather_into_tensor", output_tensor.numel(), size * input_tensor.numel(),
                "output elements (W times the input's)")
    args = (output_tensor, input_tensor, group)
    return launch(_into_tensor, args, [output_tensor], async_op)


def _into_tensor(output_tensor, input_tensor, group):
    rank, size = rank_and_size(group)
    check_same_shape(input_tensor, group, "all_gather_into_tensor")
    if input_tensor.numel() == 0:
        return
    whole = stand_ins([output_tensor])[0]
    blocks = list(whole.view(-1).split(input_tensor.numel()))
    blocks[rank].copy_(input_tensor.reshape(-1))  # (any layout: its elements in order)
    ring_all_gather(blocks, group)
    land([output_tensor], [whole])


all_gather_single = all_gather_into_tensor  # torch 2.13's name for it
