"""Mixture of experts in one process: a router sends each token to k of E expert MLPs.

    pytest tests/test_experts.py      # this layer, and expert parallelism (parallel.py) against it

A mixture-of-experts (MoE) layer holds E MLPs, the experts, where a transformer block has
one, and a router: a Linear layer whose softmax gives each token a probability per expert.
Each token goes to its k most probable experts (k = 1: Switch Transformer; k = 2: GShard),
and its output is their outputs weighted by those probabilities. A token costs k experts'
compute while the layer holds E experts' weights. In the order below:
  route      softmax, top-k: each token's k (expert, weight) pairs, and the balancing loss
  sort       the pairs sorted by expert (stable: token order within an expert), counted;
             with a capacity, each expert keeps its first C pairs and the rest are dropped
  Experts    each expert on its run of the sorted pairs (expert parallelism replaces this
             one module: parallel.py sends the runs to the ranks that hold the experts)
  combine    each pair's output back in pair order, weighted, summed over the token's k
Switch's balancing loss, E * sum_e f_e P_e (f_e: the share of pairs routed to e, P_e: e's
mean probability), is 1 for an even spread and grows as the router favours few experts;
added to the loss with a small coefficient, it pulls the router back. Without it, a router
can send most tokens to a few experts: they train and the rest do not, and under expert
parallelism their ranks do most of the work (minddp ep-bench draws it).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..launch.usage_error import UsageError


class MLP(nn.Module):
    """One expert: up, GELU, down (the small GPT's MLP)."""

    def __init__(self, d, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def route(router, tokens, top_k):
    """(weights, experts) of each token's top_k pairs, each (N, top_k); and the balancing
    loss of these tokens (Switch's: E * sum_e f_e P_e)."""
    probs = router(tokens).softmax(-1)  # (N, E)
    weights, chosen = probs.topk(top_k, dim=-1)
    num_experts = probs.shape[-1]
    share = torch.bincount(chosen.flatten(), minlength=num_experts) / chosen.numel()  # f_e
    balance = num_experts * (share * probs.mean(0)).sum()  # P_e carries the gradient
    return weights, chosen, balance


def sort_by_expert(chosen, num_experts, capacity=None):
    """(kept, counts): the pairs (numbered token * top_k + slot) sorted by expert, the first
    `capacity` of each expert kept; and how many each expert keeps (E,)."""
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # stable: an expert sees its tokens in order
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is None:  # dropless
        return order, counts
    start = torch.cumsum(counts, 0) - counts  # where each expert's run begins
    place = torch.arange(len(flat), device=flat.device) - start[flat[order]]
    return order[place < capacity], counts.clamp(max=capacity)


class Experts(nn.Module):
    """The E expert MLPs, each run on its contiguous run of tokens (sorted by expert)."""

    def __init__(self, d, hidden, num_experts):
        """E experts of width d, hidden units `hidden`; named by their number."""
        super().__init__()
        self.mlps = nn.ModuleDict({str(e): MLP(d, hidden) for e in range(num_experts)})

    def forward(self, routed, counts):
        """routed: the tokens sorted by expert, counts[e] of them for expert e."""
        runs = routed.split(counts.tolist())
        return torch.cat([mlp(run) for mlp, run in zip(self.mlps.values(), runs)])


def combine(outputs, kept, weights, num_tokens):
    """Each kept pair's output to its place, weighted; a token's top_k outputs summed.
    A dropped pair adds nothing: the block's residual carries its token on."""
    top_k = weights.shape[1]
    pairs = outputs.new_zeros(num_tokens * top_k, outputs.shape[-1]).index_copy(0, kept, outputs)
    return (pairs.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """A mixture-of-experts layer: router, top-k, experts, combine (in place of an MLP)."""

    def __init__(self, d, hidden, num_experts, top_k=1, capacity_factor=None):
        """capacity_factor: each expert takes at most ceil(factor * tokens * top_k / E) of a
        forward's pairs (None: every pair, dropless)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise UsageError(f"top_k={top_k} with {num_experts} experts: a token goes to"
                             f" 1 to {num_experts} of them", hint="top_k 1 or 2",
                             same_on_every_rank=True)
        if capacity_factor is not None and capacity_factor <= 0:
            raise UsageError(f"capacity_factor={capacity_factor}: no expert could take a"
                             f" token", hint="1.0 to 2.0, or None: dropless",
                             same_on_every_rank=True)
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = Experts(d, hidden, num_experts)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.balance_loss = None  # the last forward's, for the training loop to add
        self.tokens_per_expert = None  # the last forward's pairs kept per expert

    def forward(self, x):
        """x (..., d) -> (..., d): every token through its top_k experts."""
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen, self.balance_loss = route(self.router, tokens, self.top_k)
        kept, counts = sort_by_expert(chosen, self.num_experts, self.capacity(len(tokens)))
        self.tokens_per_expert = counts
        routed = tokens[kept // self.top_k]  # pair p is token p // top_k's
        outputs = self.experts(routed, counts)
        return combine(outputs, kept, weights, len(tokens)).view(x.shape)

    def __getstate__(self):  # copy.deepcopy() after a forward: the loss's graph stays behind
        return dict(self.__dict__, balance_loss=None)

    def capacity(self, num_tokens):
        """The most pairs an expert takes from `num_tokens` tokens (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
