"""Stock's context parallelism on CPU: the ring beneath context_parallel, as one differentiable op.

    torchrun --nproc_per_node=2 examples/context.py --cp reference

Stock's public context_parallel(...) reaches its ring through DTensor's dispatch, which on
CPU refuses the CPU attention kernel ("Operator aten._scaled_dot_product_flash_attention_
for_cpu.default does not have a sharding strategy registered"). The ring beneath it runs on
CPU: _templated_ring_attention and _templated_ring_attention_backward, given that kernel.
context_parallel() here is stock's own context manager (it cuts the buffers, with its head-
tail load balancer for zig-zag), with F.scaled_dot_product_attention inside it replaced by
those two as one autograd op: the reference minddp's context parallelism is compared with.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@contextlib.contextmanager
def _load_balance(on):
    """Stock's switch for the zig-zag parts is a module global: set it around each ring."""
    before = _cp._cp_options.enable_load_balance
    _cp._cp_options.enable_load_balance = on
    try:
        yield
    finally:
        _cp._cp_options.enable_load_balance = before


class _StockRing(torch.autograd.Function):
    """Stock's ring attention forward and backward (seq dim 2, the CPU kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, zigzag, scale):
        with _load_balance(zigzag):
            out, lse = _cp._templated_ring_attention(group, 2, FORWARD, q, k, v,
                                                     is_causal=is_causal, dropout_p=0.0,
                                                     scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.how = group, is_causal, zigzag, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, is_causal, zigzag, scale = ctx.how
        with _load_balance(zigzag):
            dq, dk, dv = _cp._templated_ring_attention_backward(
                group, 2, BACKWARD, dout, "grad_out", q, k, v, out, lse, is_causal,
                dropout_p=0.0, scale=scale)[:3]
        return dq, dk, dv, None, None, None, None


def stock_ring(q, k, v, dout, group, is_causal, zigzag):
    """Stock's ring, forward then backward, on plain tensors: [out, dq, dk, dv] (detached)."""
    with _load_balance(zigzag):
        out, lse = _cp._templated_ring_attention(group, 2, FORWARD, q, k, v,
                                                 is_causal=is_causal, dropout_p=0.0)
        grads = _cp._templated_ring_attention_backward(
            group, 2, BACKWARD, dout, "grad_out", q, k, v, out, lse, is_causal, dropout_p=0.0)
    return [out.detach(), *(g.detach() for g in grads[:3])]


def _stock_ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False, *, group, zigzag):
    if attn_mask is not None or dropout_p or enable_gqa:
        raise NotImplementedError("the reference ring takes is_causal only")
    return _StockRing.apply(query, key, value, group, is_causal, zigzag, scale)


@contextlib.contextmanager
def context_parallel(mesh, *, buffers=(), buffer_seq_dims=(), no_restore_buffers=(),
                     zigzag=True):
    """Stock's context_parallel(mesh, buffers=, buffer_seq_dims=, no_restore_buffers=), its
    attention the private ring on the CPU kernel. zigzag: stock's enable_load_balance."""
    dtensor_sdpa = None
    try:
        with _load_balance(zigzag), _cp.context_parallel(
                mesh, buffers=list(buffers), buffer_seq_dims=list(buffer_seq_dims),
                no_restore_buffers=set(no_restore_buffers)):
            dtensor_sdpa = F.scaled_dot_product_attention  # stock's: refuses the CPU kernel
            F.scaled_dot_product_attention = functools.partial(
                _stock_ring_sdpa, group=mesh.get_group(), zigzag=zigzag)
            try:
                yield
            finally:
                F.scaled_dot_product_attention = dtensor_sdpa  # stock restores its own
    finally:
        # Stock keeps each patch in a module dict it never empties; the patch holds the
        # mesh, and so the process group past its destroy: dropped here.
        _cp._replaced_functions.pop(dtensor_sdpa, None)
