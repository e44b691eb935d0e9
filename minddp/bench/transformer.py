"""The transformers the benchmarks train: blocks for tensor parallel, a small GPT for the mesh.

    minddp tp-bench --world-sizes 2 --rounds 10
    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp=2,tp=2     # gpt()

Written the way tensor parallelism needs it: q, k, v and the output projection as separate
Linear layers, and attention finding its heads from q's width (`view(B, T, -1, head_dim)`),
so the same code runs whole or with each rank holding heads / world_size of them.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import BLOCKS, HEADS, TOKENS, WIDTH  # noqa: F401  (the benchmark's sizes)
from ..ep.experts import MoE
from ..launch.usage_error import UsageError


class MLP(nn.Module):
    def __init__(self, d=8, hidden=16, bias=True):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden, bias=bias), nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Causal self-attention written for tensor parallelism: heads found from q's width."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))  # -1: this rank's heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, d=16, heads=4, dropout=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads), MLP(d, 4 * d)
        self.dropout = dropout  # nanoGPT's resid_dropout, after each branch (training only)

    def forward(self, x):
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))

    def _drop(self, y):
        return F.dropout(y, self.dropout, self.training) if self.dropout else y


class Embedding(nn.Module):
    """nanoGPT's input: a token embedding (wte) plus a learned embedding of each position."""

    def __init__(self, vocab, d, tokens):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(tokens, d)
        for table in (self.wte, self.wpe):  # nanoGPT's scale (N(0, 1), tied, gives wild logits)
            nn.init.normal_(table.weight, std=0.02)
        # The positions a buffer (torchtitan's freqs_cis): context parallelism cuts it with
        # the tokens, so each rank's tokens meet their own positions (context_parallel.py).
        self.register_buffer("positions", torch.arange(tokens), persistent=False)

    def forward(self, idx):
        if idx.shape[1] != len(self.positions):  # e.g. tokens cut, positions not
            raise UsageError(f"{idx.shape[1]} tokens but {len(self.positions)} positions",
                             hint="under context_parallel, name model[0].positions among the"
                                  " buffers (seq dim 0) beside the tokens")
        return self.wte(idx) + self.wpe(self.positions)


class Head(nn.Module):
    """nanoGPT's output: the last LayerNorm, then each token's logits over the vocabulary."""

    def __init__(self, vocab, d):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def gpt(vocab=32, d=16, heads=4, blocks=2, tokens=8, tied=True, dropout=0.0):
    """nanoGPT's shape at CPU sizes, as the nn.Sequential a pipeline cuts: embedding, blocks,
    head. tied: the output layer's weight is the token embedding's (one tensor, as nanoGPT)."""
    model = nn.Sequential(Embedding(vocab, d, tokens),
                          *(Block(d, heads, dropout) for _ in range(blocks)), Head(vocab, d))
    if tied:
        model[-1].lm_head.weight = model[0].wte.weight
    return model


def moe_gpt(vocab=32, d=16, heads=4, blocks=2, tokens=8, tied=True, experts=4, top_k=1,
            capacity_factor=None):
    """The small GPT with each block's MLP a mixture of `experts` experts (experts.py's MoE,
    each expert the MLP's size), top_k of them per token."""
    model = gpt(vocab, d, heads, blocks, tokens, tied)
    for block in model[1:-1]:
        block.mlp = MoE(d, 4 * d, experts, top_k, capacity_factor)
    return model


class Classifier(nn.Module):
    """Blocks, the mean over this rank's tokens, a 10-way head (the benchmark's loss)."""

    def __init__(self, sequence_parallel=False):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(WIDTH, HEADS) for _ in range(BLOCKS)))
        self.head, self.sequence_parallel = nn.Linear(WIDTH, 10), sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:  # this rank's slice of the tokens
            x = x.chunk(dist.get_world_size(), 1)[dist.get_rank()]
        return self.head(self.blocks(x).mean(1))
