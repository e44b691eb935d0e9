"""The one-process references for context parallelism (tests/test_context.py, the examples' tests).

    pytest tests/test_context.py

reference_attention(): every rank's part of the sequence in one process, each rank's blocks
computed in the ring's order and merged by their log-sum-exp, backward in the order the ring
adds. It is written from the positions alone, not from minddp/cp/ring_attention.py's rule: a query
sees a key at or before it (causal), and the part of a block to compute is the rows that
see any of its keys and the keys any of those rows sees; the mask within that part must be
none or the causal triangle (the one kernel call a ring makes per block), else it refuses.

one_process_gpt(): the small GPT trained on the ranks' parts of each sequence in one process:
a replica of the model per rank (its gradient is that rank's alone), the blocks' attention
by reference_attention(), the replicas' gradients added in rank order.
"""

import copy
import math

import torch
import torch.nn.functional as F

from minddp.cp.blockwise import KERNELS


def chunk_ids(rank, world_size, zigzag):
    return [rank, 2 * world_size - 1 - rank] if zigzag else [rank]


def positions(rank, length, world_size, zigzag):
    """The global positions of rank's part of a sequence of `length`, in its order."""
    chunk = length // (2 * world_size if zigzag else world_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk)
                      for c in chunk_ids(rank, world_size, zigzag)])


def part(x, dim, rank, world_size, zigzag):
    """rank's part of x along dim, by its positions."""
    return x.index_select(dim, positions(rank, x.shape[dim], world_size, zigzag))


def _span(mask):
    """The indices where mask is True, as a slice (they must be contiguous)."""
    where = mask.nonzero().flatten().tolist()
    assert where == list(range(where[0], where[-1] + 1)), "not one block: the ring cannot"
    return slice(where[0], where[-1] + 1)


def needed(q_pos, k_pos, causal):
    """(rows, cols, causal) of (queries at q_pos x keys at k_pos) to compute, or None."""
    sees = (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos),
                                                                          dtype=torch.bool)
    if not sees.any():
        return None
    rows = _span(sees.any(1))
    cols = _span(sees[rows].any(0))
    block = sees[rows, cols]
    if block.all():
        return rows, cols, False
    triangle = torch.ones_like(block).tril()
    assert torch.equal(block, triangle), "a mask other than the causal triangle"
    return rows, cols, True


def merge(out, lse, block_out, block_lse):
    """The online softmax in stock's form: w = sigmoid(lse_B - lse_A)."""
    if out is None:
        return block_out, block_lse
    return (out - torch.sigmoid(block_lse - lse) * (out - block_out),
            lse - F.logsigmoid(lse - block_lse))


def _plan(world_size, length, causal, zigzag):
    """plan[r][i]: what rank r computes at step i of the ring (its keys from rank r - i)."""
    pos = [positions(r, length, world_size, zigzag) for r in range(world_size)]
    return [[needed(pos[r], pos[(r - i) % world_size], causal) for i in range(world_size)]
            for r in range(world_size)]


def forward(qs, ks, vs, causal, zigzag, kernel="fused"):
    """Each rank's (out, lse): its blocks in the ring's order, merged in float32."""
    world_size, attend = len(qs), KERNELS[kernel][0]
    plan = _plan(world_size, world_size * qs[0].shape[2], causal, zigzag)
    outs, lses = [], []
    for r in range(world_size):
        out = lse = None
        for i in range(world_size):
            if plan[r][i] is None:
                continue
            rows, cols, mask = plan[r][i]
            s = (r - i) % world_size
            # The ring sends k and v as one contiguous message: its blocks are slices of it.
            o, l = attend(qs[r][:, :, rows], ks[s].contiguous()[:, :, cols],
                          vs[s].contiguous()[:, :, cols], mask, None)
            o, l = o.float(), l.float().unsqueeze(-1)
            if out is None:
                out, lse = o, l
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
        outs.append(out.to(qs[r].dtype))
        lses.append(lse.squeeze(-1))
    return outs, lses


def backward(douts, qs, ks, vs, outs, lses, causal, zigzag, kernel="fused"):
    """Each rank's (dq, dk, dv): dq added in step order, a block's dk and dv in the order
    the ranks hold it (its owner s first, then s + 1, ...), as the ring adds them."""
    world_size, attend_backward = len(qs), KERNELS[kernel][1]
    plan = _plan(world_size, world_size * qs[0].shape[2], causal, zigzag)
    dqs = [torch.zeros_like(q, dtype=torch.float32) for q in qs]
    dks = [torch.zeros_like(k, dtype=torch.float32) for k in ks]
    dvs = [torch.zeros_like(v, dtype=torch.float32) for v in vs]
    for i in range(world_size):  # step i: rank r holds the block of rank r - i
        for r in range(world_size):
            if plan[r][i] is None:
                continue
            rows, cols, mask = plan[r][i]
            s = (r - i) % world_size
            dq, dk, dv = attend_backward(
                douts[r][:, :, rows], qs[r][:, :, rows], ks[s].contiguous()[:, :, cols],
                vs[s].contiguous()[:, :, cols], outs[r][:, :, rows],
                lses[r][:, :, rows].contiguous(), mask, None)
            dqs[r][:, :, rows] += dq
            dks[s][:, :, cols] += dk
            dvs[s][:, :, cols] += dv
    return ([d.to(q.dtype) for d, q in zip(dqs, qs)], [d.to(k.dtype) for d, k in zip(dks, ks)],
            [d.to(v.dtype) for d, v in zip(dvs, vs)])


class _Reference(torch.autograd.Function):
    """All ranks' attention as one op of 3W inputs and W outputs."""

    @staticmethod
    def forward(ctx, causal, zigzag, kernel, *qkv):
        n = len(qkv) // 3
        qs, ks, vs = qkv[:n], qkv[n:2 * n], qkv[2 * n:]
        outs, lses = forward(qs, ks, vs, causal, zigzag, kernel)
        ctx.save_for_backward(*qkv, *outs, *lses)
        ctx.how, ctx.n = (causal, zigzag, kernel), n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        n, saved = ctx.n, ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[j * n:(j + 1) * n] for j in range(5))
        dqs, dks, dvs = backward(douts, qs, ks, vs, outs, lses, *ctx.how)
        return None, None, None, *dqs, *dks, *dvs


def reference_attention(qs, ks, vs, causal, zigzag, kernel="fused"):
    """Differentiable: [each rank's attention output] from lists of each rank's q, k, v."""
    return list(_Reference.apply(causal, zigzag, kernel, *qs, *ks, *vs))


def _block(blocks, xs, causal, zigzag):
    """bench/transformer.py's Block.forward on each rank's part with its own replica's block,
    the attention over every rank's part at once."""
    heads = []
    for block, x in zip(blocks, xs):
        h = block.ln1(x)
        heads.append([lin(h).view(*x.shape[:2], -1, block.attn.head_dim).transpose(1, 2)
                      for lin in (block.attn.q, block.attn.k, block.attn.v)])
    ys = reference_attention(*zip(*heads), causal=causal, zigzag=zigzag)
    out = []
    for block, x, y in zip(blocks, xs, ys):
        x = x + block.attn.o(y.transpose(1, 2).reshape(*x.shape[:2], -1))
        out.append(x + block.mlp(block.ln2(x)))
    return out


def gpt_losses(replicas, tokens, targets, cp, zigzag):
    """Each virtual rank's loss: replicas[r] on its part (rank r = dp_index * cp + cp_index)."""
    xs = []
    for r, model in enumerate(replicas):
        emb, c = model[0], r % cp
        pos = positions(c, tokens[r // cp].shape[1], cp, zigzag)
        idx = tokens[r // cp][:, pos]
        xs.append(emb.wte(idx) + emb.wpe(pos))
    for layer in range(1, len(replicas[0]) - 1):  # the blocks, each over its cp group
        xs = sum((_block([m[layer] for m in replicas[g:g + cp]], xs[g:g + cp], True, zigzag)
                  for g in range(0, len(xs), cp)), [])
    losses = []
    for r, (model, x) in enumerate(zip(replicas, xs)):
        pos = positions(r % cp, targets[r // cp].shape[1], cp, zigzag)
        logits = model[-1](x)
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets[r // cp][:, pos].flatten()))
    return losses


def ordered_mean(grads):
    """The ranks' gradients added in rank order, then divided by their number."""
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total / len(grads)


def one_process_gpt(model, batches, cp, dp, zigzag, lr=1e-2):
    """Train `model` on batches[step][dp_index] = (tokens, targets), its attention cut over cp
    virtual ranks: [(each virtual rank's loss, every mean gradient)] per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    seen = []
    for step_batches in batches:
        replicas = [copy.deepcopy(model) for _ in range(cp * dp)]
        tokens, targets = zip(*step_batches)
        losses = gpt_losses(replicas, tokens, targets, cp, zigzag)
        torch.autograd.backward(losses)
        optimizer.zero_grad()
        grads = []
        for name, p in model.named_parameters():
            each = [dict(m.named_parameters())[name].grad for m in replicas]
            p.grad = ordered_mean(each)
            grads.append(p.grad.clone())
        seen.append(([loss.item() for loss in losses], grads))
        optimizer.step()
    return seen


def bound(q, k, v, world_size, zigzag):
    """docs/context.md's bound on |ring - whole-sequence SDPA| for these inputs (float32):
    u max|v| [2 (2(d+2)S + n + 5) + (W-1)(8 + ((d+3)S + n + log n) / 2)], S bounding |score|."""
    u = torch.finfo(torch.float32).eps / 2  # the unit roundoff, 2^-24
    d, n = q.shape[-1], q.shape[2]
    score = (q.norm(dim=-1).max() * k.norm(dim=-1).max()).item() / math.sqrt(d)  # S
    kernel = 2 * (d + 2) * score + n + 5  # one kernel's error (a row of n keys), u max|v|
    merge = 8 + ((d + 3) * score + n + math.log(n)) / 2  # one merge's, with its lse's error
    return u * v.abs().max().item() * (2 * kernel + (world_size - 1) * merge)


def measured_share(world_sizes=(2, 4, 8), seeds=20):
    """[(ranks, causal, zigzag, largest |ring - whole|, its share of the bound)]: the
    reference against whole-sequence SDPA, 8 tokens per rank, scores up to 5x sharper."""
    rows = []
    for world_size in world_sizes:
        for causal, zigzag in [(False, False), (True, False), (True, True), (False, True)]:
            worst, share = 0.0, 0.0
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                q, k, v = (torch.randn(2, 3, 8 * world_size, 8, generator=g) for _ in range(3))
                q = q * (1 + 2 * (seed % 3))
                whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                outs, _ = forward(*[[part(t, 2, r, world_size, zigzag) for r in range(world_size)]
                                    for t in (q, k, v)], causal, zigzag)
                error = max((o - part(whole, 2, r, world_size, zigzag)).abs().max().item()
                            for r, o in enumerate(outs))
                worst = max(worst, error)
                share = max(share, error / bound(q, k, v, world_size, zigzag))
            rows.append((world_size, causal, zigzag, worst, share))
    return rows


if __name__ == "__main__":  # python tests/context_reference.py: docs/context.md's figures
    for ranks, causal, zigzag, worst, share in measured_share():
        print(f"{ranks} ranks, {'causal' if causal else 'full'}, "
              f"{'zig-zag' if zigzag else 'in order'}: largest error {worst:.2e},"
              f" {share:.2%} of the bound")
