"""Stock's context_parallel by hand: inside it the model's attention is the ring, its inputs cut.

    torchrun --nproc_per_node=2 examples/context.py --grad-table runs/cp.txt
    pytest tests/test_context.py

A model runs context parallel after two changes, and stock's context manager
(torch.distributed.tensor.experimental.context_parallel) makes both without touching it:
  the buffers   every tensor with a sequence dimension (the input tokens, the targets, a
                positions buffer of the model's) is cut in place to this rank's part, its
                chunks (zig-zag by default, as stock's load balancer), and restored on exit
  attention     F.scaled_dot_product_attention, wherever the model calls it, is ring_attention
                (ring_attention.py) over the mesh for the duration: stock patches the same name
Every other layer works on the tokens it is given. Each rank's loss is the mean over its
tokens; averaging the ranks' gradients (fully_shard or DDP over these ranks too) gives the
whole sequence's mean, since every rank holds as many tokens:

    with context_parallel(mesh["cp"], buffers=[tokens, targets, model[0].positions],
                          buffer_seq_dims=[1, 1, 0]):
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()

Stock falls back to cutting in order, silently, when the length does not split in 2 x ranks
chunks; minddp refuses instead, as it refuses what the ring cannot compute (an explicit mask,
attention dropout, grouped-query heads).
"""

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ring_attention import chunk_ids, ring_attention
from ..launch.usage_error import UsageError


def shard_sequence(x, dim, rank, world_size, zigzag):
    """This rank's part of x along dim: its chunks, joined (every rank holds x whole)."""
    chunks = x.chunk(2 * world_size if zigzag else world_size, dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world_size, zigzag)], dim)


def unshard_sequence(x, dim, group, zigzag):
    """Collective: every rank's part of a sequence -> the whole of it, in order, on each rank."""
    world_size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks = {}
    for rank, part in enumerate(parts):  # each rank's chunks, back in their places
        for c, piece in zip(chunk_ids(rank, world_size, zigzag), part.chunk(1 + zigzag, dim)):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim)


@contextlib.contextmanager
def context_parallel(mesh, *, buffers=(), buffer_seq_dims=(), no_restore_buffers=(),
                     zigzag=True, kernel=None):
    """Stock's context manager: inside it, F.scaled_dot_product_attention is the ring.

    Collective: call on every rank. Each buffer is cut in place to this rank's part along
    its buffer_seq_dim, and restored on exit (but those in no_restore_buffers)."""
    group = mesh.get_group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    check_buffers(buffers, buffer_seq_dims, no_restore_buffers, size, zigzag)
    kept = [None if any(b is n for n in no_restore_buffers) else b.clone() for b in buffers]
    for buffer, dim in zip(buffers, buffer_seq_dims):
        part = shard_sequence(buffer, dim, rank, size, zigzag)
        buffer.resize_(part.shape)  # in place: whoever holds the buffer now sees its part
        buffer.copy_(part)
    whole_attention = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = functools.partial(ring_sdpa, group=group, zigzag=zigzag,
                                                       kernel=kernel)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = whole_attention
        for buffer, whole in zip(buffers, kept):
            if whole is not None:
                buffer.resize_(whole.shape)
                buffer.copy_(whole)


def ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, group, zigzag, kernel=None):
    """F.scaled_dot_product_attention's signature, computed by the ring. Collective."""
    refused = {"attn_mask": attn_mask is not None, "dropout_p": dropout_p != 0.0,
               "enable_gqa": enable_gqa}
    for name, given in refused.items():
        if given:
            raise UsageError(f"context parallel attention takes no {name}: the ring computes"
                             f" is_causal or no mask, without dropout, with k and v's heads"
                             f" equal to q's", hint="is_causal=True instead of a causal mask;"
                             " repeat k and v's heads for grouped queries", same_on_every_rank=True)
    return ring_attention(query, key, value, group, is_causal, zigzag, kernel, scale)


def check_buffers(buffers, seq_dims, no_restore, world_size, zigzag):
    """One line for buffers the ranks cannot cut alike (on every rank the same)."""
    if len(buffers) != len(seq_dims):
        raise UsageError(f"{len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims",
                         hint="one sequence dimension per buffer", same_on_every_rank=True)
    if not all(any(n is b for b in buffers) for n in no_restore):
        raise UsageError("no_restore_buffers holds a tensor that is not in buffers",
                         hint="name a subset of buffers", same_on_every_rank=True)
    for i, b in enumerate(buffers):  # cut in place: a view would write over its neighbours
        if b.untyped_storage().nbytes() != b.numel() * b.element_size() or any(
                b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
                for c in buffers[:i]):
            raise UsageError(f"buffer {i} ({tuple(b.shape)}) shares its memory with another"
                             f" tensor (a view, e.g. tokens[:, :-1]): cutting it in place"
                             f" would overwrite the other", hint="pass .clone() of it",
                             same_on_every_rank=True)
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims)}
    if len(lengths) > 1:  # a positions buffer longer than the tokens would be cut elsewhere
        raise UsageError(f"the buffers' sequence lengths differ: {sorted(lengths)}",
                         hint="cut each buffer to the batch's length first (positions[:T])",
                         same_on_every_rank=True)
    chunks = 2 * world_size if zigzag else world_size
    for length in lengths:
        if length % chunks:
            raise UsageError(f"a sequence of {length} tokens does not split into {chunks}"
                             f" chunks ({'zig-zag: 2 x ' if zigzag else ''}{world_size} ranks)",
                             hint=f"a length that {chunks} divides", same_on_every_rank=True)
