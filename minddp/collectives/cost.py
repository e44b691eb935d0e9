"""What each algorithm costs: its steps (latency) and the bytes each rank sends (bandwidth).

    pytest tests/test_collectives.py -k bytes     # counted on every rank = sent_bytes()
    minddp collectives-bench                      # timed beside gloo's, fitted to the model

The alpha-beta model: a step costs alpha (the fixed cost of a message: the call, the
system's and the wire's latency) plus beta per byte; steps in sequence add up. So
    T(N) = steps(W) * alpha + path_bytes(N, W) * beta
where path_bytes is what the slowest chain of steps carries. N is the bytes of the tensor a
rank hands in (all_gather: the gathered output), W the ranks, blocks of N/W each:
    algorithm                   steps            path_bytes        each rank sends
    ring all_reduce             2(W-1)           2(W-1)/W N        the same
    tree all_reduce             2 ceil(log2 W)   2 ceil(log2 W) N  rank 0: ceil(log2 W) N
    halving-doubling (W = 2^k)  2 log2 W         2(W-1)/W N        the same
    all_gather, reduce_scatter  W - 1            (W-1)/W N         the same
    all_to_all (pairwise)       W - 1            (W-1)/W N         the same
    reduce (ring, then to dst)  W                2(W-1)/W N        N, dst (W-1)/W N
    tree broadcast              ceil(log2 W)     ceil(log2 W) N    N per child
    chain broadcast             K + W - 2        (K + W - 2) N/K   N (K chunks of 1 MiB)
    shape check (checks.py)     1                0                 72 (W-1) bytes
Fewer steps win for small tensors, fewer bytes for large ones; at W = 8 the tree takes 6
steps to the ring's 14, and carries 6N to the ring's 1.75N.
"""

from .tree_and_chain import CHAIN_CHUNK_BYTES


def _log2(size):
    return (size - 1).bit_length()  # ceil(log2 W)


def _children(me, size):
    """How many ranks the binomial tree's rank `me` (counted from the root) sends to."""
    return sum(1 for k in range(_log2(size)) if me < 2 ** k and me + 2 ** k < size)


def steps(algorithm, nbytes, size):
    """Rounds of messages in sequence: the alpha term."""
    power = 1 << (size.bit_length() - 1)
    chunks = max(1, -(-nbytes // CHAIN_CHUNK_BYTES))
    return {"ring all_reduce": 2 * (size - 1), "tree all_reduce": 2 * _log2(size),
            "halving-doubling": 2 * _log2(power) + (2 if power < size else 0),
            "all_gather": size - 1, "reduce_scatter": size - 1, "all_to_all": size - 1,
            "reduce": size, "tree broadcast": _log2(size),
            "chain broadcast": chunks + size - 2 if size > 1 else 0,
            "barrier": _log2(size), "shape check": 1}[algorithm]


def path_bytes(algorithm, nbytes, size):
    """Bytes along the slowest chain of steps: the beta term."""
    power = 1 << (size.bit_length() - 1)
    share = (size - 1) / size * nbytes
    chunks = max(1, -(-nbytes // CHAIN_CHUNK_BYTES))
    return {"ring all_reduce": 2 * share, "tree all_reduce": 2 * _log2(size) * nbytes,
            "halving-doubling": 2 * (power - 1) / power * nbytes + (2 * nbytes
                                                                    if power < size else 0),
            "all_gather": share, "reduce_scatter": share, "all_to_all": share,
            "reduce": 2 * share, "tree broadcast": _log2(size) * nbytes,
            "chain broadcast": (chunks + size - 2) * nbytes / chunks if size > 1 else 0,
            "barrier": _log2(size), "shape check": 0}[algorithm]  # its 72 B: all latency


def sent_bytes(algorithm, nbytes, size, rank, root=0):
    """The bytes group rank `rank` sends, exactly, when N divides into W (and 2W) blocks
    (a reduce: up to 2W MiB; past it gloo's reduce blocks are whole MiB, ring_reduce.py)."""
    power = 1 << (size.bit_length() - 1)
    extra = size - power
    share = (size - 1) * nbytes // size
    me = (rank - root) % size
    if algorithm == "halving-doubling":
        if rank < 2 * extra and rank % 2 == 0:
            return nbytes  # handed over; the sum comes back
        back = nbytes if rank < 2 * extra else 0
        return 2 * (power - 1) * nbytes // power + back
    return {"ring all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share,
            "all_to_all": share, "reduce": share if me == 0 else nbytes,
            "tree broadcast": _children(me, size) * nbytes,
            "chain broadcast": nbytes if me < size - 1 else 0,
            "tree all_reduce": (nbytes if rank else 0) + _children(rank, size) * nbytes,
            "barrier": _log2(size), "shape check": 72 * (size - 1)}[algorithm]
