"""Context parallelism by hand: each rank holds part of the sequence; keys and values go round.

    torchrun --nproc_per_node=2 examples/context.py --grad-table runs/cp.txt
    pytest tests/test_context.py      # 2 and 4 ranks: bitwise stock's ring and one process's

A sequence too long for one device is cut along its length: rank r holds its part of every
token's activations, and every layer but attention runs on its tokens alone. Attention needs
all the keys, so the ranks pass their key/value blocks round a ring: at step i, rank r holds
the block of rank r - i, attends to it, merges the result by its log-sum-exp (blockwise.py),
and has already sent the block on to rank r + 1, so the next one travels while this one is
computed. After world_size steps every query has seen every key; nobody held more than two
blocks. Backward is a ring too: the blocks go round again, and each block's key and value
gradients travel with it, every rank adding its part, until they arrive home.

Causal masks: a query sees only keys at or before it. Cut in order (chunk r on rank r),
rank 0 needs only its own block and rank W-1 every block: the last rank works W times as
long. Zig-zag cuts the sequence in 2W chunks and gives rank r chunks r and 2W-1-r, an early
one and a late one, so every rank holds the same share of the triangle:
    2 ranks, chunks 0 1 2 3     rank 0: [0, 3]    rank 1: [1, 2]
For rank r and the block of rank s, part_of_block() says what is needed: the diagonal block
(s = r) under the causal mask; in order, every key of an earlier rank and none of a later
one; zig-zag, an earlier rank's early chunk for all my queries, a later rank's keys for my
late chunk only. Stock (torch.distributed.tensor.experimental._context_parallel) computes
the same parts in the same order: _templated_ring_attention and its backward.
"""

import torch
import torch.distributed as dist

from .blockwise import KERNELS, default_kernel, merge
from .ring import pass_on
from ..launch.usage_error import UsageError

KV, GRAD_KV = 0, 1  # message tags: the blocks and their gradients travel side by side


def chunk_ids(rank, world_size, zigzag):
    """The sequence's chunks this rank holds, in order: zig-zag takes one from each end."""
    return [rank, 2 * world_size - 1 - rank] if zigzag else [rank]


def part_of_block(rank, source, is_causal, zigzag, length):
    """Of (my queries x the keys of rank `source`): (rows, cols, causal) to compute, or None.

    rows and cols slice this rank's `length` positions; causal: the mask within the part.
    """
    whole, early, late = slice(None), slice(0, length // 2), slice(length // 2, None)
    if not is_causal:
        return whole, whole, False
    if source == rank:  # the diagonal: zig-zag's two chunks, joined, need the causal mask too
        return whole, whole, True  # (its early chunk sees none of its late one's keys)
    if not zigzag:  # below the diagonal every key, above it none
        return (whole, whole, False) if source < rank else None
    if source < rank:  # its early chunk precedes both of mine; its late one follows both
        return whole, early, False
    return late, whole, False  # both of its chunks precede my late one, follow my early one


def _split(kv, like):
    """A message of keys and values, back to its two tensors (views, no copy)."""
    return kv[:like.numel()].view(like.shape), kv[like.numel():].view(like.shape)


def ring_forward(q, k, v, group, is_causal, zigzag, kernel, scale):
    """Collective: this rank's queries against every rank's keys; (out, lse) of its rows."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    attend = KERNELS[kernel][0]
    kv = torch.cat([k.flatten(), v.flatten()])  # one message per step
    out = lse = None
    for step in range(size):
        if step + 1 < size:
            incoming = pass_on(kv, group, KV)  # the next block travels while this one computes
        part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
        if part is not None:
            rows, cols, causal = part
            key, value = _split(kv, k)
            block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                          causal, scale)
            # Merged in float32 whatever the inputs (stock's convert_to_f32): a bf16 lse
            # would round each correction. Step 0 is always whole rows: it starts out.
            block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
            if out is None:
                out, lse = block_out, block_lse
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                         block_out, block_lse)
        if step + 1 < size:
            kv = incoming.wait()
    # lse in the fused kernel's dtype (float64 for float64 q), as stock's: its backward wants it
    return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))


def ring_backward(dout, q, k, v, out, lse, group, is_causal, zigzag, kernel, scale):
    """Collective: (dq, dk, dv) of this rank's q, k, v; the blocks go round once more."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    attend_backward = KERNELS[kernel][1]
    kv = torch.cat([k.flatten(), v.flatten()])
    dq = torch.zeros_like(q, dtype=torch.float32)
    grad_in = None  # the gradient of the block held, on its way from the previous rank
    for step in range(size):
        if step + 1 < size:
            incoming = pass_on(kv, group, KV)
        part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
        # The gradient of the block held now: what the ranks before added to it so far.
        grad_kv = torch.zeros_like(kv, dtype=torch.float32) if step == 0 else grad_in.wait()
        if part is not None:
            rows, cols, causal = part
            key, value = _split(kv, k)
            dk, dv = _split(grad_kv, k)
            # lse made contiguous: the kernel reads a sliced lse wrong (stock's comment)
            dq_part, dk_part, dv_part = attend_backward(
                dout[:, :, rows], q[:, :, rows], key[:, :, cols], value[:, :, cols],
                out[:, :, rows], lse[:, :, rows].contiguous(), causal, scale)
            dk[:, :, cols] += dk_part
            dv[:, :, cols] += dv_part
            dq[:, :, rows] += dq_part
        grad_in = pass_on(grad_kv, group, GRAD_KV)  # on with the block, to the next rank
        if step + 1 < size:
            kv = incoming.wait()
    dk, dv = _split(grad_in.wait(), k)  # my own block's gradient, home after a full turn
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention as one op: forward and backward are the two rings above."""

    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, zigzag, kernel, scale):
        out, lse = ring_forward(q, k, v, group, is_causal, zigzag, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.how = group, is_causal, zigzag, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = ring_backward(dout, *ctx.saved_tensors, *ctx.how)
        return *grads, None, None, None, None, None


def ring_attention(q, k, v, group=None, is_causal=False, zigzag=False, kernel=None,
                   scale=None):
    """Attention of this rank's part of the sequence against all of it: differentiable.

    Collective: call on every rank. q, k, v: this rank's (batch, heads, tokens, head_dim)
    parts of the sequence `group` holds; zigzag: the parts are chunk_ids' chunks; kernel:
    blockwise.KERNELS' (None: the fused one on CPU, by hand elsewhere)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise UsageError(f"ring attention takes q, k, v of one shape (batch, heads, tokens,"
                         f" head_dim), got {[tuple(t.shape) for t in (q, k, v)]}",
                         hint="tokens third (SDPA's layout); k and v with q's heads",
                         same_on_every_rank=True)
    if zigzag and q.shape[2] % 2:
        raise UsageError(f"zig-zag holds two chunks per rank, but this rank has {q.shape[2]}"
                         f" tokens", hint="a sequence that 2 x ranks divides",
                         same_on_every_rank=True)
    kernel = default_kernel(q.device) if kernel is None else kernel
    return _RingAttention.apply(q, k, v, group, is_causal, zigzag, kernel, scale)
