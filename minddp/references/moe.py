"""One process on the whole batch: what expert parallelism (ep/parallel.py) is compared with.

    torchrun --nproc_per_node=2 examples/experts.py --ep reference --grad-table runs/ep-ref.txt
    pytest tests/test_experts.py

one_process_moe(): W ranks' batches through one MoE layer in one process. Each rank's tokens
are routed by that rank's router (a replica: its gradient is that rank's alone) with that
rank's capacity; then each expert runs ONCE per ep group, on the rows the group's ranks
route to it in the order (rank, token): the order in which ep/parallel.py's all_to_all
delivers them.
So an expert's output and gradient are one matmul over the same rows as on its rank.

OneProcessMoEGPT: the small MoE GPT (bench/transformer.py's moe_gpt) trained that way, a
replica of the model per rank for everything but the experts, which each ep group holds once.
dense_moe(): the layer's definition in float64, every expert on every token, masked: what
the one-process layer itself (experts.py) must agree with.
"""

import copy

import torch
import torch.nn.functional as F

from ..ep.experts import MoE, combine, route, sort_by_expert


def one_process_moe(routers, experts, moe, xs, ep):
    """([each rank's output], [its balancing loss], [its pairs per expert]) for xs[r] (tokens,
    d): routers[r] rank r's router, experts[g] ep group g's Experts (ranks g*ep .. g*ep +
    ep - 1), moe the layer (top_k, capacity)."""
    routed = []
    for router, x in zip(routers, xs):
        weights, chosen, balance = route(router, x, moe.top_k)
        kept, counts = sort_by_expert(chosen, moe.num_experts, moe.capacity(len(x)))
        routed.append((weights, kept, counts, x[kept // moe.top_k], balance))
    outs = []
    for g in range(len(xs) // ep):
        group = routed[g * ep:(g + 1) * ep]
        runs = [rows.split(counts.tolist()) for _, _, counts, rows, _ in group]
        per_expert = [torch.cat([run[e] for run in runs]) for e in range(moe.num_experts)]
        done = [mlp(rows) for mlp, rows in zip(experts[g].mlps.values(), per_expert)]
        for r, (weights, kept, counts, _, _) in enumerate(group):  # rank r's rows of each
            start = [sum(len(runs[q][e]) for q in range(r)) for e in range(moe.num_experts)]
            outputs = torch.cat([done[e][start[e]:start[e] + int(counts[e])]
                                 for e in range(moe.num_experts)])
            outs.append(combine(outputs, kept, weights, len(xs[g * ep + r])))
    return outs, [r[4] for r in routed], [r[2] for r in routed]


def rank_order_sum(parts):
    """The ranks' gradients added in rank order."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class OneProcessMoEGPT:
    """The MoE GPT `model` on W ranks' batches in one process: a replica per rank for the
    weights every rank holds, the experts once per ep group (dp = W / ep groups)."""

    def __init__(self, model, world_size, ep):
        """model: the whole MoE GPT (every expert); it is what the optimizer steps."""
        self.model, self.world_size, self.ep = model, world_size, ep

    def losses(self, tokens, targets, balance_coef):
        """Collects every rank's loss (next-token cross entropy + balance_coef x the layers'
        balancing losses); after backward, grads() reads the gradients."""
        self.replicas = [copy.deepcopy(self.model) for _ in range(self.world_size)]
        self.experts = [[copy.deepcopy(m) for m in self.model.modules()
                         if isinstance(m, MoE)] for _ in range(self.world_size // self.ep)]
        xs = [replica[0](t) for replica, t in zip(self.replicas, tokens)]
        balances = [0.0] * self.world_size
        for layer in range(1, len(self.model) - 1):  # bench/transformer.py's Block.forward
            blocks = [replica[layer] for replica in self.replicas]
            hs = [x + b.attn(b.ln1(x)) for b, x in zip(blocks, xs)]
            outs, balance, counts = one_process_moe(
                [b.mlp.router for b in blocks], [e[layer - 1].experts for e in self.experts],
                blocks[0].mlp, [b.ln2(h).reshape(-1, h.shape[-1]) for b, h in zip(blocks, hs)],
                self.ep)
            xs = [h + o.view(h.shape) for h, o in zip(hs, outs)]
            if layer == 1:
                self.tokens_per_expert = counts  # each rank's pairs per expert, first block
            balances = [a + b for a, b in zip(balances, balance)]
        return [F.cross_entropy(replica[-1](x).flatten(0, 1), y.flatten()) + balance_coef * b
                for replica, x, y, b in zip(self.replicas, xs, targets, balances)]

    def gradients(self, sum_ranks=rank_order_sum):
        """{name: gradient}, averaged as ep.sync_gradients averages them: a replicated
        weight's rank parts summed by sum_ranks (in rank order, or the run's all_reduce), an
        expert's over the ep groups in order; each divided by W."""
        grads = {}
        for name in dict(self.model.named_parameters()):
            if ".mlp.experts." in name:
                total = rank_order_sum([_named(e, name) for e in self.experts])
            else:
                total = sum_ranks([dict(r.named_parameters())[name].grad for r in self.replicas])
            grads[name] = total / self.world_size
        return grads


def _named(moes, name):
    """The gradient of `name` (the whole model's name) in a list of the model's MoE copies."""
    block, rest = name.split(".mlp.experts.")
    return dict(moes[int(block) - 1].experts.named_parameters())[rest].grad


def dense_moe(moe, x):
    """The layer by its definition, float64: sum over experts of mask * weight * expert(x)."""
    moe, x = copy.deepcopy(moe).double(), x.double()
    probs = moe.router(x).softmax(-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    out = torch.zeros_like(x)
    for e, mlp in enumerate(moe.experts.mlps.values()):
        gate = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 unless e was chosen
        out += gate * mlp(x)
    return out


def balance_by_definition(moe, x):
    """Switch's E * sum_e f_e P_e, written out with a loop."""
    probs = F.softmax(moe.router(x), -1)
    chosen = probs.topk(moe.top_k, dim=-1).indices
    total = 0.0
    for e in range(moe.num_experts):
        total = total + (chosen == e).sum().item() / chosen.numel() * probs[:, e].mean()
    return moe.num_experts * total
