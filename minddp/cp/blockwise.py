"""Attention one block of keys at a time: each block's output and log-sum-exp, and the merge.

    pytest tests/test_context.py      # the ring built on these (ring_attention.py), bitwise stock's

Attention is the one layer that mixes positions: query row i's output is a softmax over
its scores s_j = q_i . k_j * scale against every key j, weighting the values v_j. The keys
need not be in one place. A block B of them gives, besides its output, the log of its
softmax's denominator, its log-sum-exp:
    lse_B = log sum_{j in B} exp(s_j)          out_B = sum_{j in B} exp(s_j - lse_B) v_j
and two blocks A and B of the same rows merge exactly (the online softmax of FlashAttention):
    lse = log(exp(lse_A) + exp(lse_B))         out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B
merge() writes it with w = exp(lse_B - lse) = sigmoid(lse_B - lse_A), as stock does, so
no exp() can overflow:
    out = out_A - w (out_A - out_B)            lse = lse_A - logsigmoid(lse_A - lse_B)
Backward needs no merge. Given the whole row's lse and out (saved by the forward), key j's
share of the softmax is exp(s_j - lse) wherever j is, so each block's backward, run alone,
yields exactly its own part of dq, and the whole of its keys' and values' gradients from
these rows (FlashAttention's backward, by_hand_backward below).

Two kernels compute one block, the same contract (out, lse) and (dq, dk, dv):
  by_hand   the scores as a matmul, masked, weighted by exp(s - lse): every step in sight,
            on any device
  fused     torch's own kernel, on CPU aten._scaled_dot_product_flash_attention_for_cpu (what
            F.scaled_dot_product_attention runs there) and its backward: the kernel stock's
            ring attention calls, so the ring can be compared with stock's bit for bit
"""

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _scores(q, k, is_causal, scale):
    """q . k * scale for every (query, key) pair; a key after its query masked to -inf."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale  # SDPA's default
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:  # top-left aligned, as SDPA's is_causal: row i sees keys 0..i of the block
        later = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    return scores


def by_hand(q, k, v, is_causal, scale):
    """One block's attention in plain matmuls: (out, lse), lse one number per query row."""
    scores = _scores(q, k, is_causal, scale)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v  # each row's softmax over this block
    return out, lse


def by_hand_backward(dout, q, k, v, out, lse, is_causal, scale):
    """One block's gradients, given the WHOLE row's out and lse: (dq, dk, dv) of this block."""
    p = torch.exp(_scores(q, k, is_causal, scale) - lse.unsqueeze(-1)).to(q.dtype)  # its share
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.transpose(-2, -1)
    # The softmax's backward needs sum_j p_j dp_j over the WHOLE row, every block's keys:
    # it equals dout . out (the whole output), so no block needs another block's scores.
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def fused(q, k, v, is_causal, scale):
    """One block with torch's fused CPU kernel: (out, lse)."""
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p=0.0, is_causal=is_causal, scale=scale)
    return out, lse


def fused_backward(dout, q, k, v, out, lse, is_causal, scale):
    """The fused kernel's backward for one block, given the whole row's out and lse."""
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)


KERNELS = {"by_hand": (by_hand, by_hand_backward), "fused": (fused, fused_backward)}


def default_kernel(device):
    """The fused kernel where torch has it for a lone block with its lse (CPU); else by hand."""
    return "fused" if torch.device(device).type == "cpu" else "by_hand"


def merge(out, lse, block_out, block_lse):
    """The online softmax: the same rows' (out, lse) over two blocks of keys -> over both.

    lse carries a trailing dimension of 1 (it scales whole rows of out). None: no block yet.
    """
    if out is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse
