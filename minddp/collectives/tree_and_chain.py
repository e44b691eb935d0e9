"""broadcast: one rank's tensor copied to every rank, two ways: a binomial tree, a chain.

    pytest tests/test_collectives.py -k broadcast   # both bit for bit dist.broadcast's

Ranks are counted from the source: relative rank me = (rank - src) mod W, so the source is
0 whichever rank it is.
The tree: in round k the 2^k ranks that hold the tensor each send it to one that does not
(me -> me + 2^k), so ceil(log2 W) rounds reach everyone. Few rounds, but the source sends
the whole tensor in each of them: best when the tensor is small and a round's fixed cost
(its latency) is what counts.
The chain: the source cuts the tensor into chunks and sends them down a line of ranks
(me -> me + 1), each rank passing chunk c on while chunk c + 1 arrives. Every rank sends
the tensor once, and the last chunk arrives W - 2 steps after the source sent it: best when
the tensor is large and the bytes (bandwidth) are what counts.
No arithmetic: every rank ends with the source's bits, whichever way they travelled.
"""

from ..launch.groups import is_member
from .checks import check_same_shape, flat_memory
from .p2p import exchange, group_rank, rank_and_size
from .work import launch

CHAIN_CHUNK_BYTES = 1 << 20  # 1 MiB a step (gloo's segment): a step is not all latency


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy global rank src's tensor into every rank's, in place, down a binomial tree.

    Collective: call on every rank. Stock's signature (torch.distributed.broadcast)."""
    return _start(binomial_tree, tensor, src, group, async_op, group_src, "broadcast")


def chain_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy global rank src's tensor into every rank's, in place, down a pipelined chain.

    Collective: call on every rank. broadcast()'s signature."""
    return _start(pipelined_chain, tensor, src, group, async_op, group_src, "chain_broadcast")


def _start(algorithm, tensor, src, group, async_op, group_src, what):
    if not is_member(group):
        return None  # stock's rule: a rank outside the group takes no part
    flat = flat_memory(tensor, what)  # its bytes as they lie: a transposed view too
    root = group_src if group_src is not None else group_rank(group, src or 0, what)
    return launch(_checked, (algorithm, tensor, flat, root, group, what), [tensor], async_op)


def _checked(algorithm, tensor, flat, root, group, what):
    check_same_shape(tensor, group, what)
    algorithm(flat, root, group)


def binomial_tree(tensor, root, group):
    """Collective: call on every rank. Copy group rank root's tensor down the binomial tree
    (also the second half of tree.py)."""
    rank, size = rank_and_size(group)
    me = (rank - root) % size
    step = 1
    while step < size:
        if me < step and me + step < size:  # I hold it already: pass it on
            exchange(group, sends=[(tensor, (me + step + root) % size)])
        elif step <= me < 2 * step:  # this round reaches me
            exchange(group, receives=[(tensor, (me - step + root) % size)])
        step *= 2


def pipelined_chain(tensor, root, group):
    """Collective: call on every rank. Copy group rank root's tensor down a line of ranks,
    chunk by chunk."""
    rank, size = rank_and_size(group)
    me = (rank - root) % size
    flat = tensor.view(-1)
    chunks = flat.split(max(1, CHAIN_CHUNK_BYTES // flat.element_size()))
    before, after = (rank - 1) % size, (rank + 1) % size
    # At step t the source sends chunk t; rank `me` receives chunk c at step c + me - 1 and
    # passes it on at step c + me, both posted together: one link busy per rank and step.
    for t in range(len(chunks) + size - 2):
        sends, receives = [], []
        if me < size - 1 and 0 <= t - me < len(chunks):
            sends.append((chunks[t - me], after))
        if me > 0 and 0 <= t - me + 1 < len(chunks):
            receives.append((chunks[t - me + 1], before))
        exchange(group, sends, receives)

