"""Right solutions written from the exercises' TODOs alone, not as the lessons write them:
each must pass (stock's bits) or be graded `correct` (tests/test_grade.py).

    pytest tests/test_grade.py -k right

{exercise: {solution: {"Class.method" or "function": its body}}}: minddp.grader.writer.
solution() writes each into the exercise's starting file, as a student would.
"""

RIGHT = {
    'experts': {
        'experts A': {
            '_AllToAll.backward': """\
send, recv, group = ctx.how
# the gradient rows are what arrived: recv[j] of them go back to rank j
home = torch.empty(sum(send), *grad.shape[1:], dtype=grad.dtype, device=grad.device)
dist.all_to_all_single(home, grad.contiguous(), output_split_sizes=send,
                       input_split_sizes=recv, group=group)
return home, None, None, None
""",
            'ExpertsOnRanks.forward': """\
ep = dist.get_world_size(self.group)
# (1) what each rank sends to each of my experts
theirs = torch.empty_like(counts)
dist.all_to_all_single(theirs, counts.contiguous(), group=self.group)
mine_from = theirs.view(ep, self.per_rank)  # [source rank][my expert]
send = [int(c) for c in counts.view(ep, self.per_rank).sum(1)]
recv = [int(c) for c in mine_from.sum(1)]
arrived = all_to_all(routed, send, recv, self.group)  # (2)
# (3) per source its run, cut per expert; each expert's pieces in source order
pieces = [run.split(mine_from[j].tolist()) for j, run in enumerate(arrived.split(recv))]
outs = []
for e, mlp in enumerate(self.mlps.values()):  # (4)
    rows = torch.cat([pieces[j][e] for j in range(ep)])
    outs.append(mlp(rows).split([len(pieces[j][e]) for j in range(ep)]))
# (5) source-major again: for each source, its pieces expert by expert
back = torch.cat([outs[e][j] for j in range(ep) for e in range(self.per_rank)])
return all_to_all(back, recv, send, self.group)
""",
            'sync_gradients': """\
world_size = dist.get_world_size()
holders = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
local = set()
for module in model.modules():
    if isinstance(module, ExpertsOnRanks):
        local.update(id(p) for p in module.parameters())
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) in local:
        if holders is not None and dist.get_world_size(holders) > 1:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=holders)
    else:
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    p.grad.div_(world_size)
""",
        },
        'experts B': {
            '_AllToAll.backward': """\
send, recv, group = ctx.how
return all_to_all(grad, recv, send, group), None, None, None
""",
            'ExpertsOnRanks.forward': """\
ep = self.num_experts // self.per_rank
counts_in = torch.empty_like(counts)
dist.all_to_all_single(counts_in, counts, group=self.group)
table = counts_in.reshape(ep, self.per_rank)
send = counts.reshape(ep, self.per_rank).sum(dim=1).tolist()
recv = table.sum(dim=1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
# each arrived row's place once regrouped: expert e's rows start after the experts
# before it, then after the rows the sources before this one sent to e
per_expert = table.sum(0)
expert_start = torch.cumsum(per_expert, 0) - per_expert
source_start = torch.cumsum(table, 0) - table  # [j][e]: rows to e from ranks < j
place = torch.cat([expert_start[e] + source_start[j, e] + torch.arange(int(table[j, e]))
                   for j in range(ep) for e in range(self.per_rank)]).long()
grouped = torch.empty_like(arrived).index_copy(0, place, arrived)
runs = grouped.split(per_expert.tolist())
outputs = torch.cat([mlp(run) for mlp, run in zip(self.mlps.values(), runs)])
return all_to_all(outputs[place], recv, send, self.group)
""",
            'sync_gradients': """\
dp = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
world = mesh.size()
for module in model.modules():
    if isinstance(module, ExpertsOnRanks):
        for p in module.parameters():
            if p.grad is not None:
                if dp is not None:
                    dist.all_reduce(p.grad, group=dp)
                p.grad.mul_(1.0 / world)
experts = {p for m in model.modules() if isinstance(m, ExpertsOnRanks)
           for p in m.parameters()}
for p in model.parameters():
    if p.grad is not None and p not in experts:
        dist.all_reduce(p.grad)
        p.grad.mul_(1.0 / world)
""",
        },
    },
    'clip': {
        'clip A': {
            '_whole': """\
total = norm.pow(2)
dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
return total.sqrt()
""",
            'weight_norms': """\
tp_norms, other_norms, done = [], [], set()
for layer in module.modules():
    sliced = SLICES.get(layer)
    for attr, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in done:
            continue
        done.add(id(p))
        is_dtensor = isinstance(p.grad, DTensor)
        n = torch.linalg.vector_norm(p.grad.to_local() if is_dtensor else p.grad)
        if is_dtensor and "dp" in mesh.mesh_dim_names:
            n = _whole(n, mesh["dp"].get_group())
        if sliced is not None and attr in sliced:
            n = _whole(n, mesh["tp"].get_group())
        (tp_norms if sliced is not None else other_norms).append(n)
out = {}
if tp_norms:
    out["tp layers"] = tp_norms
if other_norms:
    out["others"] = other_norms
return out
""",
            'clip_grad_norm_': """\
squares = torch.zeros(())
for norms in weight_norms(module, mesh).values():
    squares = squares + torch.linalg.vector_norm(torch.stack(norms)) ** 2
total = squares ** 0.5
if "pp" in mesh.mesh_dim_names:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
for p in module.parameters():
    if p.grad is not None:
        p.grad.mul_(coef)
return total
""",
        },
        'clip B': {
            '_whole': """\
squared = norm * norm
dist.all_reduce(squared, group=group)
return squared ** 0.5
""",
            'weight_norms': """\
dims = mesh.mesh_dim_names
groups = {"tp layers": [], "others": []}
seen = set()
for layer in module.modules():
    for attr, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        n = torch.linalg.vector_norm(local, 2.0)
        if "dp" in dims and isinstance(p.grad, DTensor):
            n = _whole(n, mesh["dp"].get_group())
        if "tp" in dims and attr in SLICES.get(layer, {}):
            n = _whole(n, mesh["tp"].get_group())
        groups["tp layers" if layer in SLICES else "others"].append(n)
return {k: v for k, v in groups.items() if v}
""",
            'clip_grad_norm_': """\
per_group = [torch.linalg.vector_norm(torch.stack(v)) for v in weight_norms(module,
                                                                            mesh).values()]
total = torch.zeros(())
for g in per_group:
    total += g ** 2
total = total ** 0.5
if "pp" in mesh.mesh_dim_names:
    total = total ** 2
    dist.all_reduce(total, group=mesh["pp"].get_group())
    total = total ** 0.5
scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
for p in module.parameters():
    if p.grad is not None:
        p.grad.mul_(scale)
return total
""",
        },
        'clip C': {  # the TODO's own formula, the scale a Python float
            '_whole': """\
total = norm.pow(2)
dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
return total.sqrt()
""",
            'weight_norms': """\
found = {}
seen = set()
for layer in module.modules():
    for attr, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        n = torch.linalg.vector_norm(grad.to_local() if isinstance(grad, DTensor) else grad)
        if isinstance(grad, DTensor) and "dp" in mesh.mesh_dim_names:
            n = _whole(n, mesh["dp"].get_group())
        if layer in SLICES and attr in SLICES[layer]:
            n = _whole(n, mesh["tp"].get_group())
        found.setdefault("tp layers" if layer in SLICES else "others", []).append(n)
return found
""",
            'clip_grad_norm_': """\
squares = torch.zeros(())
for norms in weight_norms(module, mesh).values():
    squares = squares + torch.linalg.vector_norm(torch.stack(norms)) ** 2
total = squares ** 0.5
if "pp" in mesh.mesh_dim_names:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
scale = min(max_norm / (float(total) + 1e-6), 1.0)
for p in module.parameters():
    if p.grad is not None:
        p.grad.mul_(scale)
return total
""",
        },
        'clip D': {  # every norm's square summed at once: another order than stock's
            '_whole': """\
total = norm.pow(2)
dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
return total.sqrt()
""",
            'weight_norms': """\
found = {}
seen = set()
for layer in module.modules():
    for attr, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        n = torch.linalg.vector_norm(grad.to_local() if isinstance(grad, DTensor) else grad)
        if isinstance(grad, DTensor) and "dp" in mesh.mesh_dim_names:
            n = _whole(n, mesh["dp"].get_group())
        if layer in SLICES and attr in SLICES[layer]:
            n = _whole(n, mesh["tp"].get_group())
        found.setdefault("tp layers" if layer in SLICES else "others", []).append(n)
return found
""",
            'clip_grad_norm_': """\
norms = [n for group in weight_norms(module, mesh).values() for n in group]
squares = torch.stack(norms).pow(2).sum()
if "pp" in mesh.mesh_dim_names:
    dist.all_reduce(squares, group=mesh["pp"].get_group())
total = squares.sqrt()
coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
for p in module.parameters():
    if p.grad is not None:
        p.grad.mul_(coef)
return total
""",
        },
    },
    'ring_attention': {
        'ring attention A': {
            'chunk_ids': """\
ids = [rank]
if zigzag:
    ids.append(2 * world_size - 1 - rank)
return ids
""",
            'part_of_block': """\
size = max(rank, source) + 1  # any ring this large gives the same answer
n = len(chunk_ids(0, size, zigzag))
chunk = length // n
def positions(r):
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk)
                      for c in chunk_ids(r, size, zigzag)])
mine, theirs = positions(rank), positions(source)
if is_causal:
    sees = theirs[None, :] <= mine[:, None]
else:
    sees = torch.ones(length, length, dtype=torch.bool)
if not sees.any():
    return None
rows = sees.any(1).nonzero().flatten()
rows = slice(int(rows[0]), int(rows[-1]) + 1)
cols = sees[rows].any(0).nonzero().flatten()
cols = slice(int(cols[0]), int(cols[-1]) + 1)
return rows, cols, not bool(sees[rows, cols].all())
""",
            'ring_forward': """\
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
held = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    nxt = pass_on(held, group, KV) if step < size - 1 else None
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(held, k)
        o, l = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols], causal, scale)
        o, l = o.to(torch.float32), l.to(torch.float32)[..., None]
        if out is None:
            out, lse = o, l
        else:
            merged = merge(out[:, :, rows], lse[:, :, rows], o, l)
            out[:, :, rows] = merged[0]
            lse[:, :, rows] = merged[1]
    if nxt is not None:
        held = nxt.wait()
return out.to(q.dtype), lse[..., 0].to(torch.promote_types(q.dtype, torch.float32))
""",
        },
        'ring attention B': {
            'chunk_ids': """\
if not zigzag:
    return [rank]
return [rank, (2 * world_size - 1) - rank]
""",
            'part_of_block': """\
half = length // 2
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if rank == source:
    return everything, everything, True
if zigzag:
    if source > rank:  # its keys come before my second chunk only
        return slice(half, length), everything, False
    return everything, slice(0, half), False
if source > rank:
    return None
return everything, everything, False
""",
            'ring_forward': """\
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
step = 0
while step < size:
    incoming = pass_on(kv, group, KV) if step + 1 < size else None
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        o, l = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols], causal, scale)
        o, l = o.float(), l.float().unsqueeze(-1)
        if out is None:
            out, lse = o, l
        else:
            a_out, a_lse = out[:, :, rows], lse[:, :, rows]
            out[:, :, rows] = a_out - torch.sigmoid(l - a_lse) * (a_out - o)
            lse[:, :, rows] = a_lse - torch.nn.functional.logsigmoid(a_lse - l)
    if incoming is not None:
        kv = incoming.wait()
    step += 1
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
        },
    },
    'naive': {
        'naive A': {
            'NaiveDDP._average_gradient': """\
if not self._sync_this_backward:
    return
if not self._arrived:
    at_end_of_backward(self._end_of_backward)
self._arrived.add(id(param))
param.grad.div_(self.world_size)
chosen.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
""",
        },
        'naive B': {
            'NaiveDDP._average_gradient': """\
sync = self._sync_this_backward
if sync:
    first = len(self._arrived) == 0
    self._arrived.add(id(param))
    if first:  # one check per backward, queued with the first gradient
        at_end_of_backward(self._end_of_backward)
    grad = param.grad
    torch.div(grad, self.world_size, out=grad)
    if self.world_size > 1:
        chosen.all_reduce(grad, group=self.process_group)
""",
        },
    },
    'bucketed': {
        'bucketed A': {
            'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
bucket.pending -= 1
while self._next_bucket < len(self.buckets):
    nxt = self.buckets[self._next_bucket]
    if nxt.pending > 0:
        break
    nxt.work = self._reduce_bucket(nxt, self._next_bucket)
    self._next_bucket += 1
""",
            'BucketedDDP._copy_into_bucket': """\
torch.div(self._params[index].grad, self.world_size, out=view)
""",
            'BucketedDDP._end_of_backward': """\
missing = [name for i, name in enumerate(self._names) if i not in self._ready]
if missing:
    self._reset()
    raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
    self._copy_out_of_bucket(bucket, flat)
self._reset()
""",
        },
        'bucketed B': {
            'BucketedDDP._mark_ready': """\
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
self._ready.add(index)
bucket.pending = bucket.pending - 1
for position in range(self._next_bucket, len(self.buckets)):
    b = self.buckets[position]
    if b.pending:
        return
    b.work = self._reduce_bucket(b, position)
    self._next_bucket = position + 1
""",
            'BucketedDDP._copy_into_bucket': """\
grad = self._params[index].grad
view.copy_(grad.view_as(view) / self.world_size)
""",
            'BucketedDDP._end_of_backward': """\
launched = self.buckets[:self._next_bucket]
flats = [self._wait_for_bucket(b, pos) for pos, b in enumerate(launched)]
missing = [self._names[i] for i in range(len(self._params)) if i not in self._ready]
complete = not missing and len(launched) == len(self.buckets)
if complete:
    for b, flat in zip(launched, flats):
        self._copy_out_of_bucket(b, flat)
self._reset()
if missing:
    raise missing_gradients_error(missing)
""",
        },
    },
    'sampler': {
        'sampler A': {
            'ShardSampler.__iter__': """\
n = len(self.dataset)
if self.shuffle:
    g = torch.Generator()
    g.manual_seed(self.seed + self.epoch)
    indices = torch.randperm(n, generator=g).tolist()
else:
    indices = list(range(n))
if self.drop_last:
    indices = indices[:self.total_size]
else:
    while len(indices) < self.total_size:
        indices += indices[:self.total_size - len(indices)]
return iter(indices[self.rank:self.total_size:self.num_replicas])
""",
        },
        'sampler B': {
            'ShardSampler.__iter__': """\
import itertools
n = len(self.dataset)
order = range(n)
if self.shuffle:
    gen = torch.Generator().manual_seed(self.seed + self.epoch)
    order = torch.randperm(n, generator=gen).tolist()
padded = list(itertools.islice(itertools.cycle(order), self.total_size)) if n else []
for position in range(self.rank, len(padded), self.num_replicas):
    yield padded[position]
""",
        },
    },
    'broadcast': {
        'broadcast A': {
            'broadcast_parameters': """\
if dist.get_world_size(group) == 1:
    return
root = global_rank(group, src)
tensors = list(module.parameters())
if buffers:
    tensors += list(module.buffers())
for t in tensors:
    dist.broadcast(t, src=root, group=group)
""",
        },
        'broadcast B': {
            'broadcast_parameters': """\
if dist.get_world_size(group) == 1:
    return
root = global_rank(group, src)
tensors = [p for _, p in module.named_parameters()]
if buffers:
    tensors.extend(b for _, b in module.named_buffers())
# one broadcast per (dtype, device): the tensors flattened back to back
kinds = {}
for t in tensors:
    kinds.setdefault((t.dtype, t.device), []).append(t)
for same in kinds.values():
    flat = torch.cat([t.reshape(-1) for t in same])
    dist.broadcast(flat, src=root, group=group)
    offset = 0
    for t in same:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
""",
        },
    },
    'zero': {
        'zero A': {
            'ShardedOptimizer._shards': """\
per_rank = [[] for _ in range(self.world_size)]
sizes = [0] * self.world_size
for group in self.param_groups:
    mine = [[] for _ in range(self.world_size)]
    for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
        rank = sizes.index(min(sizes))
        mine[rank].append(p)
        sizes[rank] += p.numel()
    for rank, params in enumerate(mine):
        shard = dict(group)
        shard["params"] = params
        per_rank[rank].append(shard)
return per_rank
""",
            'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
if self.world_size > 1:
    for rank, groups in enumerate(self.partition):
        owner = global_rank(self.process_group, rank)
        for group in groups:
            for p in group["params"]:
                dist.broadcast(p, src=owner, group=self.process_group)
return loss
""",
        },
        'zero B': {
            'ShardedOptimizer._shards': """\
import copy
held = {r: 0 for r in range(self.world_size)}
result = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    params = list(group["params"])
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    split = {r: [] for r in held}
    for i in order:
        rank = min(held, key=lambda r: (held[r], r))
        split[rank].append(params[i])
        held[rank] += params[i].numel()
    for r in range(self.world_size):
        g = copy.copy(group)
        g["params"] = split[r]
        result[r].append(g)
return result
""",
            'ShardedOptimizer.step': """\
if closure is None:
    loss = self.optim.step()
else:
    loss = self.optim.step(closure=closure)
owner_of = {p: r for r, groups in enumerate(self.partition)
            for g in groups for p in g["params"]}
for group in self.param_groups:
    for p in group["params"]:
        if self.world_size > 1:
            src = global_rank(self.process_group, owner_of[p])
            dist.broadcast(p.data, src=src, group=self.process_group)
return loss
""",
        },
    },
    'fsdp': {
        'fsdp A': {
            'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    send = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        send.append(F.pad(local, (0, p.block_numel - local.numel())))
    send = torch.cat(send)
    gathered = torch.empty(self.world_size * send.numel(), dtype=send.dtype,
                           device=send.device)
    dist.all_gather_into_tensor(gathered, send, group=self.group)
    per_rank = gathered.view(self.world_size, send.numel())
    offset = 0
    for p in self.params:
        blocks = per_rank[:, offset:offset + p.block_numel]
        whole = blocks.reshape(self.world_size * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(whole[:p.full.shape[0]])  # .data: autograd saved p.full
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
            'Unit.reduce_scatter': """\
rows_of_rank = []
for r in range(self.world_size):
    for p, g in zip(params, grads):
        piece = g[r * p.rows:(r + 1) * p.rows].reshape(-1)
        rows_of_rank.append(F.pad(piece, (0, p.block_numel - piece.numel())))
flat = torch.cat(rows_of_rank)
mine = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(mine, flat, op=dist.ReduceOp.AVG, group=self.group)
out, offset = [], 0
for p in params:
    block = mine[offset:offset + p.block_numel].view(p.rows, *p.full.shape[1:])
    start = min(self.rank * p.rows, p.full.shape[0])
    end = min(start + p.rows, p.full.shape[0])
    out.append(self.as_dtensor(block[:end - start], p.full))
    offset += p.block_numel
return out
""",
        },
        'fsdp B': {
            'Unit.unshard': """\
if not self.is_unsharded:
    per_rank = sum(p.block_numel for p in self.params)
    if per_rank:
        first = self.params[0].full
        flat = torch.zeros(self.world_size, per_rank, dtype=first.dtype, device=first.device)
        mine = flat[self.rank]
        start = 0
        for p in self.params:
            local = p.shard.to_local()
            mine[start:start + local.numel()].copy_(local.reshape(-1))
            start += p.block_numel
        parts = list(flat.unbind(0))
        dist.all_gather(parts, mine.clone(), group=self.group)
        start = 0
        for p in self.params:
            n0 = p.full.shape[0]
            p.full.untyped_storage().resize_(p.full.nbytes)
            for r in range(self.world_size):
                lo, hi = min(r * p.rows, n0), min((r + 1) * p.rows, n0)
                if hi > lo:
                    got = parts[r][start:start + (hi - lo) * (p.block_numel // p.rows)]
                    with torch.autograd._unsafe_preserve_version_counter(p.full):
                        p.full[lo:hi].copy_(got.view(hi - lo, *p.full.shape[1:]))
            p.show(p.full)
            start += p.block_numel
    self.is_unsharded = True
""",
            'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
at = 0
for p, g in zip(params, grads):
    row_numel = p.block_numel // p.rows
    for r in range(ws):
        lo, hi = min(r * p.rows, g.shape[0]), min((r + 1) * p.rows, g.shape[0])
        flat[r, at:at + (hi - lo) * row_numel] = g[lo:hi].reshape(-1)
    at += p.block_numel
result = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(result, flat.reshape(-1), op=dist.ReduceOp.AVG, group=self.group)
blocks, at = [], 0
for p in params:
    n0 = p.full.shape[0]
    lo, hi = min(self.rank * p.rows, n0), min((self.rank + 1) * p.rows, n0)
    row_numel = p.block_numel // p.rows
    block = result[at:at + (hi - lo) * row_numel].view(hi - lo, *p.full.shape[1:])
    blocks.append(self.as_dtensor(block, p.full))
    at += p.block_numel
return blocks
""",
        },
    },
    'pp': {
        'pp A': {
            'one_f_one_b': """\
warmup = min(n, num_stages - stage_index)
actions = [("F", i) for i in range(warmup)]
for i in range(n - warmup):
    actions += [("B", i), ("F", warmup + i)]
actions += [("B", i) for i in range(n - warmup, n)]
return actions
""",
        },
        'pp B': {
            'one_f_one_b': """\
order = []
forwards = backwards = 0
while forwards < min(n, num_stages - stage_index):
    order.append(("F", forwards))
    forwards += 1
while backwards < n:
    order.append(("B", backwards))
    backwards += 1
    if forwards < n:
        order.append(("F", forwards))
        forwards += 1
return order
""",
        },
    },
    'ring': {
        'ring A': {
            'ring_reduce_scatter': """\
rank, size = rank_and_size(group)
for step in range(size - 1):
    send = (rank + step + 1) % size
    recv = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv])
    exchange(group, sends=[(blocks[send], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    combine(op, blocks[recv], arrived)
""",
        },
        'ring B': {
            'ring_reduce_scatter': """\
me, world = rank_and_size(group)
before, after = (me - 1 + world) % world, (me + 1) % world
outgoing = after  # my own block rank + 1 goes first
steps = 0
while steps < world - 1:
    incoming = (outgoing + 1) % world
    buffer = blocks[incoming].new_empty(blocks[incoming].shape)
    exchange(group, [(blocks[outgoing], before)], [(buffer, after)])
    combine(op, blocks[incoming], buffer)  # mine <- op(mine, arrived)
    outgoing = incoming  # next: the partial sum just made
    steps += 1
""",
        },
        'ring C': {  # stock's isend/irecv; one buffer for the largest block, none posted empty
            'ring_reduce_scatter': """\
import torch.distributed as dist
rank, size = rank_and_size(group)
spare = torch.empty(max(b.numel() for b in blocks), dtype=blocks[0].dtype)
for step in range(size - 1):
    out, into = blocks[(rank + step + 1) % size], blocks[(rank + step + 2) % size]
    works = []
    if out.numel():
        works.append(dist.isend(out, (rank - 1) % size, group=group))
    if into.numel():  # the whole spare: gloo fills its front with the smaller block
        works.append(dist.irecv(spare, (rank + 1) % size, group=group))
    for work in works:
        work.wait()
    combine(op, into, spare[:into.numel()])
""",
        },
        'ring D': {  # the other way round: to rank + 1, from rank - 1
            'ring_reduce_scatter': """\
rank, size = rank_and_size(group)
for step in range(size - 1):
    out = blocks[(rank - step - 1) % size]  # my own block rank - 1 first, then each sum
    into = blocks[(rank - step - 2) % size]
    arrived = torch.empty_like(into)
    exchange(group, sends=[(out, (rank + 1) % size)], receives=[(arrived, (rank - 1) % size)])
    combine(op, into, arrived)
""",
        },
    },
    'mesh': {
        'mesh A': {
            'grid_groups': """\
grid = torch.arange(math.prod(shape)).reshape(tuple(shape))
lines = grid.movedim(dim, -1).reshape(-1, shape[dim])
return lines.tolist()
""",
            'grid_coordinate': """\
coordinate = []
for size in reversed(tuple(shape)):
    rank, index = divmod(rank, size)
    coordinate.append(index)
return coordinate[::-1]
""",
        },
        'mesh B': {
            'grid_groups': """\
shape = list(shape)
strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
others = [range(n) if d != dim else range(1) for d, n in enumerate(shape)]
groups = []
for corner in itertools.product(*others):
    base = sum(c * s for c, s in zip(corner, strides))
    groups.append([base + i * strides[dim] for i in range(shape[dim])])
return groups
""",
            'grid_coordinate': """\
grid = torch.arange(math.prod(shape)).reshape(tuple(shape))
return [int(i) for i in (grid == rank).nonzero()[0]]
""",
        },
    },
    'recompute': {
        'recompute A': {
            'checkpoint': """\
tensors = [a for a in tree_leaves((args, kwargs)) if torch.is_tensor(a)]
versions = [t._version for t in tensors]
devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
kinds = sorted({"cpu"} | {t.device.type for t in tensors})
autocast = {k: (torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds}
cache = torch.is_autocast_cache_enabled()
cpu_state = torch.get_rng_state() if preserve_rng_state else None
cuda_states = [torch.cuda.get_rng_state(d) for d in devices] if preserve_rng_state else []
kept = []
count = [0]
answers = {}

def pack(t):
    count[0] += 1
    return count[0] - 1

def rerun():
    if [t._version for t in tensors] != versions:
        raise RuntimeError("checkpoint: an argument was changed in place after the forward;"
                           " its recomputation would differ")
    got = []

    def pack_again(t):
        got.append(t.detach())
        if len(got) == count[0]:
            raise _Stop
        return None

    cut_args, cut_kwargs = tree_map(_cut, args), tree_map(_cut, kwargs)
    with torch.random.fork_rng(devices=devices, enabled=preserve_rng_state):
        if preserve_rng_state:
            torch.set_rng_state(cpu_state)
            for d, s in zip(devices, cuda_states):
                torch.cuda.set_rng_state(s, d)
        with contextlib.ExitStack() as stack:
            for k, (on, dtype) in autocast.items():
                stack.enter_context(torch.autocast(k, enabled=on, dtype=dtype,
                                                   cache_enabled=cache))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack_again,
                                                                          lambda x: x))
            if save_ops:
                stack.enter_context(Reuse(kept, save_ops))
            try:
                function(*cut_args, **cut_kwargs)
            except _Stop:
                pass
    answers.update(enumerate(got))

def unpack(n):
    if n not in answers:
        rerun()
    return answers.pop(n)

with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
    with (Keep(kept, save_ops) if save_ops else contextlib.nullcontext()):
        return function(*args, **kwargs)
""",
        },
        'recompute B': {
            'checkpoint': """\
flat_inputs = [x for x in tree_leaves((args, kwargs)) if torch.is_tensor(x)]
before = [x._version for x in flat_inputs]
gpus = sorted({x.get_device() for x in flat_inputs if x.is_cuda})
rng = None
if preserve_rng_state:
    rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(g) for g in gpus])
amp = [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
       for dev in {"cpu", *(x.device.type for x in flat_inputs)}]
amp_cache = torch.is_autocast_cache_enabled()
kept = []
state = {"n": 0, "slots": []}

def pack(tensor):
    number = state["n"]
    state["n"] = number + 1
    return number

def run_again():
    for x, v in zip(flat_inputs, before):
        if x._version != v:
            raise RuntimeError("an argument of checkpoint() was modified in place since its"
                               " forward: the recomputed tensors would not match")
    slots = []

    def collect(tensor):
        slots.append(tensor.detach())
        if len(slots) >= state["n"]:
            raise _Stop()

    with torch.random.fork_rng(devices=gpus, enabled=rng is not None):
        if rng is not None:
            torch.set_rng_state(rng[0])
            for g, s in zip(gpus, rng[1]):
                torch.cuda.set_rng_state(s, g)
        stack = contextlib.ExitStack()
        with stack:
            for dev, enabled, dtype in amp:
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled,
                                                   cache_enabled=amp_cache))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(collect, lambda t: t))
            if save_ops:
                stack.enter_context(Reuse(kept, save_ops))
            try:
                with torch.enable_grad():
                    function(*[_cut(a) for a in args],
                             **{k: _cut(v) for k, v in kwargs.items()})
            except _Stop:
                pass
    state["slots"] = slots

def unpack(number):
    slots = state["slots"]
    if number >= len(slots) or slots[number] is None:
        run_again()
        slots = state["slots"]
    tensor, slots[number] = slots[number], None
    return tensor

hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
mode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()
with hooks, mode:
    out = function(*args, **kwargs)
return out
""",
        },
    },
    'interleaved': {
        'interleaved A': {
            'interleaved_1f1b': """\
per_round = rounds(pp, n)
total = n * n_local
per_hop = 1 if zero_bubble else 2
warmup = min((n_local - 1) * per_round + per_hop * (pp - 1 - rank), total)
forwards, backwards = {}, {}

def forward(op):
    stage = ((op // per_round) % n_local) * pp + rank
    i = forwards.get(stage, 0)
    forwards[stage] = i + 1
    return _action(stage, "F", i)

actions = [forward(op) for op in range(warmup)]
waiting = []  # (stage, microbatch) of each I whose W is still to come
for op in range(warmup, warmup + total):
    if op < total:
        actions.append(forward(op))
    stage = (n_local - 1 - ((op - warmup) // per_round) % n_local) * pp + rank
    i = backwards.get(stage, 0)
    backwards[stage] = i + 1
    if not zero_bubble:
        actions.append(_action(stage, "B", i))
        continue
    actions.append(_action(stage, "I", i))
    waiting.append((stage, i))
    if op - warmup >= rank:
        oldest_stage, oldest_i = waiting.pop(0)
        actions.append(_action(oldest_stage, "W", oldest_i))
actions += [_action(s, "W", i) for s, i in waiting]
return actions
""",
        },
        'interleaved B': {
            'interleaved_1f1b': """\
import collections
import itertools
per_round = rounds(pp, n)
total = n * n_local
warmup = min((n_local - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), total)
f_stages = [rank + pp * ((op // per_round) % n_local) for op in range(total)]
b_stages = [rank + pp * (n_local - 1 - (k // per_round) % n_local) for k in range(total)]
seen_f, seen_b = collections.Counter(), collections.Counter()

def numbered(stage, kind, seen):
    seen[stage] += 1
    return stage, kind, seen[stage] - 1

head = [numbered(s, "F", seen_f) for s in f_stages[:warmup]]
steady = []
for k, f in itertools.zip_longest(range(total), f_stages[warmup:]):
    if f is not None:
        steady.append(numbered(f, "F", seen_f))
    steady.append(numbered(b_stages[k], "I" if zero_bubble else "B", seen_b))
    if zero_bubble and k >= rank:
        steady.append("W")  # the oldest I's W, filled in below
head += steady
# fill each W placeholder with the oldest I still without its W
out, open_i = [], collections.deque()
for a in head:
    if a == "W":
        s, _, i = open_i.popleft()
        out.append(_action(s, "W", i))
    else:
        if a[1] == "I":
            open_i.append(a)
        out.append(_action(*a))
out += [_action(s, "W", i) for s, _, i in open_i]
return out
""",
        },
    },
    'zero_bubble': {
        'zero_bubble A': {
            'add_bubbles': """\
out = [[] for _ in lists]
at = [0] * len(lists)
done = set()  # (stage, kind, i) placed in an earlier slot
while any(at[r] < len(lists[r]) for r in range(len(lists))):
    placed = set()
    for r, actions in enumerate(lists):
        if at[r] >= len(actions):
            continue
        action = actions[at[r]]
        if action is None:
            out[r].append(None)
            at[r] += 1
            continue
        stage, kind, i = parse_action(action)
        if kind == "F" and stage > 0 and (stage - 1, "F", i) not in done:
            out[r].append(None)  # its input is not there yet: wait
            continue
        out[r].append(action)
        placed.add((stage, kind, i))
        at[r] += 1
    done |= placed
return out
""",
        },
        'zero_bubble B': {
            'add_bubbles': """\
queues = [list(reversed(actions)) for actions in lists]  # pop() gives the next action
result = [[] for _ in queues]
seen = set()
while True:
    busy = [r for r, q in enumerate(queues) if q]
    if not busy:
        break
    this_slot = []
    for r in busy:
        nxt = queues[r][-1]
        waits = False
        if nxt is not None:
            s, kind, i = parse_action(nxt)
            waits = kind == "F" and s > 0 and f"{s - 1}F{i}" not in seen
        if waits:
            result[r].append(None)
        else:
            result[r].append(queues[r].pop())
            if nxt is not None:
                this_slot.append(nxt)
    seen.update(this_slot)
return result
""",
        },
    },
    'tp': {
        'tp A': {
            'ColwiseParallel._whole': """\
if self.sequence_dim is not None:  # each rank holds a slice of the sequence: gather it
    return gather_sequence(x, self.sequence_dim, group)
if region is not None and region.gave(name, x):
    return x  # gathered already: the gather's backward sums the gradient
return copy_to_ranks(x, group)
""",
            'RowwiseParallel._forward': """\
bias = module.bias
if bias is not None:
    bias = ShareOfBias.apply(bias, dist.get_world_size(group))
partial = F.linear(x, module.weight, bias)
if self.sequence_dim is None:
    return sum_over_ranks(partial, group)
return scatter_sequence(partial, self.sequence_dim, group)
""",
        },
        'tp B': {
            'ColwiseParallel._whole': """\
gathered = region is not None and region.gave(name, x)
if self.sequence_dim is None and gathered:
    whole = x
elif self.sequence_dim is None:
    whole = copy_to_ranks(x, group=group)
else:
    whole = gather_sequence(x, dim=self.sequence_dim, group=group)
return whole
""",
            'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
out = x @ module.weight.t()
if module.bias is not None:
    out = out + ShareOfBias.apply(module.bias, ws)
if self.sequence_dim is None:
    return sum_over_ranks(out, group=group)
return scatter_sequence(out, dim=self.sequence_dim, group=group)
""",
        },
    },
}
