"""all_to_all: every rank sends its r-th piece to rank r, pair by pair, W - 1 steps.

    pytest tests/test_collectives.py -k all_to_all   # bit for bit dist.all_to_all's

A transpose of the pieces: rank r's input piece j becomes rank j's output piece r. In step
s (s = 1 .. W-1) each rank sends to the rank s after it and receives from the rank s before
it, so every step pairs all ranks up at once and no rank waits on two peers in one step;
its own piece it copies. Each rank sends (W-1)/W of its input, like a ring, but every piece
goes straight to its rank: no piece is forwarded, nothing is added, the bits are gloo's.
Pieces may differ in size (all_to_all_single's split sizes), as long as what rank i sends
to rank j is what rank j expects from rank i; that is not checked across ranks here (it
would cost a round as long as the exchange itself), only the local lengths are.
"""

from ..launch.groups import is_member
from .checks import check_contiguous, check_count, check_output, check_tensor
from .p2p import exchange, land, rank_and_size, stand_ins
from .work import launch


def pairwise_exchange(outputs, inputs, group):
    """Collective: call on every rank. outputs[r] <- rank r's inputs[me], step by step."""
    rank, size = rank_and_size(group)
    # send and recv move bytes as they lie: an input with another layout goes as a copy in
    # order, an output with another layout receives into a stand-in (any layout, as gloo's)
    inputs = [tensor.contiguous() for tensor in inputs]
    received = stand_ins(outputs)
    received[rank].copy_(inputs[rank])
    for step in range(1, size):
        to, came_from = (rank + step) % size, (rank - step) % size
        exchange(group, sends=[(inputs[to], to)], receives=[(received[came_from], came_from)])
    land(outputs, received)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Send input_tensor_list[r] to group rank r; receive rank r's into output_tensor_list[r].

    Collective: call on every rank. Stock's signature (torch.distributed.all_to_all)."""
    if not is_member(group):
        return None
    rank, size = rank_and_size(group)
    for tensors, check in ((output_tensor_list, check_output),
                           (input_tensor_list, check_tensor)):  # (an input: any layout)
        check_count("all_to_all", len(tensors), size, "tensors in a list")
        for tensor in tensors:
            check(tensor, "all_to_all")
    args = (list(output_tensor_list), list(input_tensor_list), group)
    return launch(pairwise_exchange, args, output_tensor_list, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """all_to_all of one tensor's pieces along dim 0 (equal ones, or the split sizes given).

    Collective: call on every rank. Stock's signature (dist.all_to_all_single)."""
    if not is_member(group):
        return None
    rank, size = rank_and_size(group)
    check_output(output, "all_to_all_single")
    # torch 2.13's refuses an input (ValueError), and writes such an output wrong
    check_contiguous(output, "all_to_all_single", "torch 2.13's gloo writes it wrong")
    check_contiguous(input, "all_to_all_single", "torch 2.13's refuses it too")
    outputs = _pieces(output, output_split_sizes, size, "output")
    inputs = _pieces(input, input_split_sizes, size, "input")
    return launch(pairwise_exchange, (outputs, inputs, group), [output], async_op)


def _pieces(tensor, split_sizes, size, what):
    """W views of `tensor` along dim 0 (contiguous: a slice of rows of a contiguous tensor)."""
    if split_sizes is None:
        rows = tensor.shape[0] if tensor.dim() else 1
        check_count("all_to_all_single", rows % size, 0,
                    f"{what} rows left over after {size} equal pieces of {rows}")
        split_sizes = [rows // size] * size
    check_count("all_to_all_single", len(split_sizes), size, f"{what} split sizes")
    check_count("all_to_all_single", sum(split_sizes), tensor.shape[0],
                f"{what} rows in the split sizes")
    return list(tensor.split(list(split_sizes)))
