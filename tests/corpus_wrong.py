"""Wrong solutions written from the exercises' TODOs alone, as students would write them, and
what the grader says of each (tests/test_grade.py).

    pytest tests/test_grade.py -k wrong_solution

{exercise: {solution: {...}}}, each solution:
  mistake   what it does wrong
  ranks     the world size its mistake shows at
  alone     it raises on some ranks only, or hangs: graded by `minddp grade` in ranks of its
            own (the others share one set of ranks per world size)
  verdict   "named": the diagnosis says what is wrong; "caught": it fails, and the diagnosis
            says where, not why (docs/grade.md counts them apart)
  said      words the first failed check's diagnosis holds
  hangs     (if given) it hangs on real ranks, and the words name why: the grader stops the
            ranks as soon as their calls show it (ranks/mismatch.py), not at --timeout
  bodies    {"Class.method" or "function": its body}: minddp.grader.writer.solution()
            writes each into the exercise's starting file
"""

WRONG = {
    'broadcast': {
        'w_buffers_always': dict(
            mistake='buffers broadcast even when buffers=False',
            ranks=2, alone=False, verdict='named',
            said='a buffer was copied, though buffers=False',
            bodies={
                'broadcast_parameters': """\
src_global = global_rank(group, src)
tensors = [p for _, p in module.named_parameters()]
if True:
    tensors += [b for _, b in module.named_buffers()]
for t in tensors:
    dist.broadcast(t.data, src=src_global, group=group)
""",
            }),
        'w_copy_not_inplace': dict(
            mistake='broadcast into a clone, rebinds a local name',
            ranks=2, alone=False, verdict='named',
            said='rank 1 still holds its own 0.weight: nothing was copied into it, in',
            bodies={
                'broadcast_parameters': """\
src_global = global_rank(group, src)
for name, p in module.named_parameters():
    received = p.detach().clone()
    dist.broadcast(received, src=src_global, group=group)
    p = received  # rebinds the name only
if buffers:
    for name, b in module.named_buffers():
        dist.broadcast(b, src=src_global, group=group)
""",
            }),
        'w_no_buffers': dict(
            mistake='buffers never broadcast',
            ranks=2, alone=False, verdict='named',
            said='rank 1 still holds its own 1.running_mean: nothing was copied into',
            bodies={
                'broadcast_parameters': """\
src_global = global_rank(group, src)
tensors = [p for _, p in module.named_parameters()]
if False:
    tensors += [b for _, b in module.named_buffers()]
for t in tensors:
    dist.broadcast(t.data, src=src_global, group=group)
""",
            }),
        'w_no_group': dict(
            mistake='dist.broadcast without group=',
            ranks=3, alone=True, verdict='named', hangs=True,
            said='on the whole world (no group= given), which rank 0, outside the group, never joins',
            bodies={
                'broadcast_parameters': """\
src_global = global_rank(group, src)
tensors = [p for _, p in module.named_parameters()]
if buffers:
    tensors += [b for _, b in module.named_buffers()]
for t in tensors:
    dist.broadcast(t.data, src=src_global)
""",
            }),
        'w_src_grouprank': dict(
            mistake='src=group rank (no global_rank)',
            ranks=3, alone=True, verdict='named',
            said='src and dst are global ranks',
            bodies={
                'broadcast_parameters': """\
src_global = src
tensors = [p for _, p in module.named_parameters()]
if buffers:
    tensors += [b for _, b in module.named_buffers()]
for t in tensors:
    dist.broadcast(t.data, src=src_global, group=group)
""",
            }),
        'w_trainable_only': dict(
            mistake='only requires_grad parameters broadcast (frozen skipped; stock DDP syncs them)',
            ranks=2, alone=False, verdict='named',
            said='rank 1 still holds its own 0.bias: nothing was copied into it, in',
            bodies={
                'broadcast_parameters': """\
src_global = global_rank(group, src)
tensors = [p for _, p in module.named_parameters() if p.requires_grad]
if buffers:
    tensors += [b for _, b in module.named_buffers()]
for t in tensors:
    dist.broadcast(t.data, src=src_global, group=group)
""",
            }),
    },
    'bucketed': {
        'w_decrement_after_launch': dict(
            mistake='pending decremented after the launch loop (a bucket launches one gradient late; last never)',
            ranks=2, alone=False, verdict='caught',
            said="rank 1's gradients differ from rank 0's, where stock's are the same",
            bodies={
                'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
    position = self._next_bucket
    ready = self.buckets[position]
    ready.work = self._reduce_bucket(ready, position)
    self._next_bucket += 1
bucket.pending -= 1
""",
                'BucketedDDP._copy_into_bucket': """\
grad = self._params[index].grad
torch.mul(grad, 1.0 / self.world_size, out=view)
""",
                'BucketedDDP._end_of_backward': """\
missing = [n for i, n in enumerate(self._names) if i not in self._ready]
if missing:
    self._reset()
    raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
    self._copy_out_of_bucket(bucket, flat)
self._reset()
""",
            }),
        'w_if_not_while': dict(
            mistake='launches at most one bucket per gradient (if, not while)',
            ranks=2, alone=False, verdict='named',
            said="rank 1's gradients differ from rank 0's, where stock's are the same",
            bodies={
                'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
bucket.pending -= 1
if self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
    position = self._next_bucket
    ready = self.buckets[position]
    ready.work = self._reduce_bucket(ready, position)
    self._next_bucket += 1
""",
                'BucketedDDP._copy_into_bucket': """\
grad = self._params[index].grad
torch.mul(grad, 1.0 / self.world_size, out=view)
""",
                'BucketedDDP._end_of_backward': """\
missing = [n for i, n in enumerate(self._names) if i not in self._ready]
if missing:
    self._reset()
    raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
    self._copy_out_of_bucket(bucket, flat)
self._reset()
""",
            }),
        'w_launch_any_full': dict(
            mistake='launches any full bucket immediately, not strictly in bucket order',
            ranks=2, alone=False, verdict='named',
            said='launched before bucket',
            bodies={
                'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
bucket.pending -= 1
if bucket.pending == 0:  # launched as soon as it is full, whatever its position
    bucket.work = self._reduce_bucket(bucket, self.buckets.index(bucket))
""",
                'BucketedDDP._copy_into_bucket': """\
grad = self._params[index].grad
torch.mul(grad, 1.0 / self.world_size, out=view)
""",
                'BucketedDDP._end_of_backward': """\
missing = [n for i, n in enumerate(self._names) if i not in self._ready]
if missing:
    self._reset()
    raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
    self._copy_out_of_bucket(bucket, flat)
self._reset()
""",
            }),
        'w_no_copy_out': dict(
            mistake='never copies averages back into .grad',
            ranks=2, alone=False, verdict='named',
            said="rank 1's gradients differ from rank 0's, where stock's are the same",
            bodies={
                'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
bucket.pending -= 1
while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
    position = self._next_bucket
    ready = self.buckets[position]
    ready.work = self._reduce_bucket(ready, position)
    self._next_bucket += 1
""",
                'BucketedDDP._copy_into_bucket': """\
grad = self._params[index].grad
torch.mul(grad, 1.0 / self.world_size, out=view)
""",
                'BucketedDDP._end_of_backward': """\
missing = [n for i, n in enumerate(self._names) if i not in self._ready]
if missing:
    self._reset()
    raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
self._reset()
""",
            }),
        'w_no_reset': dict(
            mistake='_end_of_backward never calls _reset',
            ranks=2, alone=False, verdict='caught',
            said="rank 1's gradients differ from rank 0's, where stock's are the same",
            bodies={
                'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
bucket.pending -= 1
while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
    position = self._next_bucket
    ready = self.buckets[position]
    ready.work = self._reduce_bucket(ready, position)
    self._next_bucket += 1
""",
                'BucketedDDP._copy_into_bucket': """\
grad = self._params[index].grad
torch.mul(grad, 1.0 / self.world_size, out=view)
""",
                'BucketedDDP._end_of_backward': """\
missing = [n for i, n in enumerate(self._names) if i not in self._ready]
if missing:
        raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
    self._copy_out_of_bucket(bucket, flat)
""",
            }),
        'w_no_scale': dict(
            mistake='gradient copied unscaled',
            ranks=2, alone=False, verdict='named',
            said="2.000x stock's, every gradient: summed, not averaged: divide by the",
            bodies={
                'BucketedDDP._mark_ready': """\
self._ready.add(index)
bucket, view = self._where[index]
self._copy_into_bucket(index, view)
bucket.pending -= 1
while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
    position = self._next_bucket
    ready = self.buckets[position]
    ready.work = self._reduce_bucket(ready, position)
    self._next_bucket += 1
""",
                'BucketedDDP._copy_into_bucket': """\
view.copy_(self._params[index].grad)
""",
                'BucketedDDP._end_of_backward': """\
missing = [n for i, n in enumerate(self._names) if i not in self._ready]
if missing:
    self._reset()
    raise missing_gradients_error(missing)
for position, bucket in enumerate(self.buckets):
    flat = self._wait_for_bucket(bucket, position)
    self._copy_out_of_bucket(bucket, flat)
self._reset()
""",
            }),
    },
    'clip': {
        'wrong_coef_not_clamped': dict(
            mistake='clip coefficient not clamped to 1.0',
            ranks=2, alone=False, verdict='named',
            said='the scale not clamped to 1: max_norm / (total + 1e-6) = 157.121 > 1',
            bodies={
                '_whole': """\
# TODO (_whole): the norm of the whole from each rank's norm of its part: square it,
# all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5).
squared = norm ** 2
dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
return squared ** 0.5
""",
                'weight_norms': """\
# TODO (weight_norms): for each parameter with a gradient, once (a tied weight once), in
# module.modules() order: torch.linalg.vector_norm of this rank's gradient (its to_local()
# if a DTensor); made whole over dp if it is fully_shard's block (a DTensor gradient),
# then over tp if it is a TP slice (SLICES[layer] names the attribute); a copy (DDP's
# replica over dp, a weight TP leaves whole) as it is; the norms grouped as stock's
# meshes: "tp layers" (the layers in SLICES) and "others".
norms, seen = {"tp layers": [], "others": []}, set()
for layer in module.modules():
    slices = SLICES.get(layer, {})
    for name, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local)
        if isinstance(grad, DTensor):
            norm = _whole(norm, grad.device_mesh.get_group())
        if name in slices:
            norm = _whole(norm, slices[name][1])
        norms["tp layers" if layer in SLICES else "others"].append(norm)
return norms
""",
                'clip_grad_norm_': """\
# TODO (clip_grad_norm_): each group's total: vector_norm of its norms stacked; the total:
# the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:
# squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm / (total
# + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils.clip_grads_with_norm_
# with foreach=False does this: it takes the parameters, and scales their .grad); return
# the total (before clipping).
totals = [torch.linalg.vector_norm(torch.stack(v)) for v in weight_norms(module, mesh).values() if v]
total = torch.zeros(())
for t in totals:
    total += t * t
total = torch.sqrt(total)
if "pp" in (mesh.mesh_dim_names or ()):
    total = _whole(total, mesh["pp"].get_group())
coef = max_norm / (total + 1e-6)
done = set()
for p in module.parameters():
    if p.grad is not None and id(p) not in done:
        done.add(id(p))
        p.grad.mul_(coef)
return total
""",
            }),
        'wrong_copy_summed_over_tp': dict(
            mistake="every param of a TP'd layer reduced over tp (the whole bias too)",
            ranks=2, alone=False, verdict='named',
            said="a copy counted tp times: the row split's bias is whole on every tp",
            bodies={
                '_whole': """\
# TODO (_whole): the norm of the whole from each rank's norm of its part: square it,
# all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5).
squared = norm ** 2
dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
return squared ** 0.5
""",
                'weight_norms': """\
# TODO (weight_norms): for each parameter with a gradient, once (a tied weight once), in
# module.modules() order: torch.linalg.vector_norm of this rank's gradient (its to_local()
# if a DTensor); made whole over dp if it is fully_shard's block (a DTensor gradient),
# then over tp if it is a TP slice (SLICES[layer] names the attribute); a copy (DDP's
# replica over dp, a weight TP leaves whole) as it is; the norms grouped as stock's
# meshes: "tp layers" (the layers in SLICES) and "others".
norms, seen = {"tp layers": [], "others": []}, set()
for layer in module.modules():
    slices = SLICES.get(layer, {})
    for name, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local)
        if isinstance(grad, DTensor):
            norm = _whole(norm, grad.device_mesh.get_group())
        if slices:  # a TP'd layer: every weight of it reduced over tp
            norm = _whole(norm, next(iter(slices.values()))[1])
        norms["tp layers" if layer in SLICES else "others"].append(norm)
return norms
""",
                'clip_grad_norm_': """\
# TODO (clip_grad_norm_): each group's total: vector_norm of its norms stacked; the total:
# the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:
# squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm / (total
# + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils.clip_grads_with_norm_
# with foreach=False does this: it takes the parameters, and scales their .grad); return
# the total (before clipping).
total = torch.zeros(())
for group_norms in weight_norms(module, mesh).values():
    if group_norms:
        total = total + torch.linalg.vector_norm(torch.stack(group_norms)) ** 2
total = total ** 0.5
if mesh.mesh_dim_names and "pp" in mesh.mesh_dim_names:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters() if p.grad is not None],
                                     max_norm, total, foreach=False)
return total
""",
            }),
        'wrong_no_pp': dict(
            mistake='stage totals not reduced over pp',
            ranks=2, alone=False, verdict='named',
            said='the stages not summed over pp: each pipeline stage holds its own',
            bodies={
                '_whole': """\
# TODO (_whole): the norm of the whole from each rank's norm of its part: square it,
# all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5).
squared = norm ** 2
dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
return squared ** 0.5
""",
                'weight_norms': """\
# TODO (weight_norms): for each parameter with a gradient, once (a tied weight once), in
# module.modules() order: torch.linalg.vector_norm of this rank's gradient (its to_local()
# if a DTensor); made whole over dp if it is fully_shard's block (a DTensor gradient),
# then over tp if it is a TP slice (SLICES[layer] names the attribute); a copy (DDP's
# replica over dp, a weight TP leaves whole) as it is; the norms grouped as stock's
# meshes: "tp layers" (the layers in SLICES) and "others".
norms, seen = {"tp layers": [], "others": []}, set()
for layer in module.modules():
    slices = SLICES.get(layer, {})
    for name, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local)
        if isinstance(grad, DTensor):
            norm = _whole(norm, grad.device_mesh.get_group())
        if name in slices:
            norm = _whole(norm, slices[name][1])
        norms["tp layers" if layer in SLICES else "others"].append(norm)
return norms
""",
                'clip_grad_norm_': """\
# TODO (clip_grad_norm_): each group's total: vector_norm of its norms stacked; the total:
# the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:
# squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm / (total
# + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils.clip_grads_with_norm_
# with foreach=False does this: it takes the parameters, and scales their .grad); return
# the total (before clipping).
total = torch.zeros(())
for group_norms in weight_norms(module, mesh).values():
    if group_norms:
        total = total + torch.linalg.vector_norm(torch.stack(group_norms)) ** 2
total = total ** 0.5
if False:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters() if p.grad is not None],
                                     max_norm, total, foreach=False)
return total
""",
            }),
        'wrong_no_sqrt': dict(
            mistake='_whole returns the sum of squares (no sqrt)',
            ranks=2, alone=False, verdict='named',
            said="the sqrt missed: the parts' squares were added over the group but the",
            bodies={
                '_whole': """\
# TODO (_whole): the norm of the whole from each rank's norm of its part: square it,
# all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5).
squared = norm ** 2
dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
return squared
""",
                'weight_norms': """\
# TODO (weight_norms): for each parameter with a gradient, once (a tied weight once), in
# module.modules() order: torch.linalg.vector_norm of this rank's gradient (its to_local()
# if a DTensor); made whole over dp if it is fully_shard's block (a DTensor gradient),
# then over tp if it is a TP slice (SLICES[layer] names the attribute); a copy (DDP's
# replica over dp, a weight TP leaves whole) as it is; the norms grouped as stock's
# meshes: "tp layers" (the layers in SLICES) and "others".
norms, seen = {"tp layers": [], "others": []}, set()
for layer in module.modules():
    slices = SLICES.get(layer, {})
    for name, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local)
        if isinstance(grad, DTensor):
            norm = _whole(norm, grad.device_mesh.get_group())
        if name in slices:
            norm = _whole(norm, slices[name][1])
        norms["tp layers" if layer in SLICES else "others"].append(norm)
return norms
""",
                'clip_grad_norm_': """\
# TODO (clip_grad_norm_): each group's total: vector_norm of its norms stacked; the total:
# the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:
# squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm / (total
# + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils.clip_grads_with_norm_
# with foreach=False does this: it takes the parameters, and scales their .grad); return
# the total (before clipping).
total = torch.zeros(())
for group_norms in weight_norms(module, mesh).values():
    if group_norms:
        total = total + torch.linalg.vector_norm(torch.stack(group_norms)) ** 2
total = total ** 0.5
if mesh.mesh_dim_names and "pp" in mesh.mesh_dim_names:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters() if p.grad is not None],
                                     max_norm, total, foreach=False)
return total
""",
            }),
        'wrong_scale_2^-20': dict(
            mistake='every gradient scaled by 2^-20 more than max_norm / (total + 1e-6), clamped',
            ranks=2, alone=False, verdict='named',
            said='units (of u) from it, where a right scale, however computed, stays within 6',
            bodies={
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
total = total
coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) * (1 + 2 ** -20)
for p in module.parameters():
    if p.grad is not None:
        p.grad.mul_(coef)
return total
""",
            }),
        'wrong_total_2^-10': dict(
            mistake='the total 2^-10 too large (and the scale from it)',
            ranks=2, alone=False, verdict='caught',
            said="not the norm of the whole model's gradient, nor a usual mistake's: yours is 1.001x",
            bodies={
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
total = total * (1 + 2 ** -10)
coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
for p in module.parameters():
    if p.grad is not None:
        p.grad.mul_(coef)
return total
""",
            }),
        'wrong_sum_of_norms': dict(
            mistake='_whole all_reduces the norms themselves (no squaring, no sqrt)',
            ranks=2, alone=False, verdict='named',
            said="the squares not taken, and no root: the ranks' norms of their parts were added over the group",
            bodies={
                '_whole': """\
# TODO (_whole): the norm of the whole from each rank's norm of its part: square it,
# all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5).
squared = norm.clone()
dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
return squared
""",
                'weight_norms': """\
# TODO (weight_norms): for each parameter with a gradient, once (a tied weight once), in
# module.modules() order: torch.linalg.vector_norm of this rank's gradient (its to_local()
# if a DTensor); made whole over dp if it is fully_shard's block (a DTensor gradient),
# then over tp if it is a TP slice (SLICES[layer] names the attribute); a copy (DDP's
# replica over dp, a weight TP leaves whole) as it is; the norms grouped as stock's
# meshes: "tp layers" (the layers in SLICES) and "others".
norms, seen = {"tp layers": [], "others": []}, set()
for layer in module.modules():
    slices = SLICES.get(layer, {})
    for name, p in layer.named_parameters(recurse=False):
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local)
        if isinstance(grad, DTensor):
            norm = _whole(norm, grad.device_mesh.get_group())
        if name in slices:
            norm = _whole(norm, slices[name][1])
        norms["tp layers" if layer in SLICES else "others"].append(norm)
return norms
""",
                'clip_grad_norm_': """\
# TODO (clip_grad_norm_): each group's total: vector_norm of its norms stacked; the total:
# the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:
# squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm / (total
# + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils.clip_grads_with_norm_
# with foreach=False does this: it takes the parameters, and scales their .grad); return
# the total (before clipping).
total = torch.zeros(())
for group_norms in weight_norms(module, mesh).values():
    if group_norms:
        total = total + torch.linalg.vector_norm(torch.stack(group_norms)) ** 2
total = total ** 0.5
if mesh.mesh_dim_names and "pp" in mesh.mesh_dim_names:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters() if p.grad is not None],
                                     max_norm, total, foreach=False)
return total
""",
            }),
        'wrong_tied_twice': dict(
            mistake='tied weight counted twice (no seen-set)',
            ranks=2, alone=False, verdict='named',
            said="a tied weight counted twice: the embedding's weight is also the output layer's",
            bodies={
                '_whole': """\
# TODO (_whole): the norm of the whole from each rank's norm of its part: square it,
# all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5).
squared = norm ** 2
dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
return squared ** 0.5
""",
                'weight_norms': """\
# TODO (weight_norms): for each parameter with a gradient, once (a tied weight once), in
# module.modules() order: torch.linalg.vector_norm of this rank's gradient (its to_local()
# if a DTensor); made whole over dp if it is fully_shard's block (a DTensor gradient),
# then over tp if it is a TP slice (SLICES[layer] names the attribute); a copy (DDP's
# replica over dp, a weight TP leaves whole) as it is; the norms grouped as stock's
# meshes: "tp layers" (the layers in SLICES) and "others".
norms, seen = {"tp layers": [], "others": []}, set()
for layer in module.modules():
    slices = SLICES.get(layer, {})
    for name, p in layer.named_parameters(recurse=False):
        if p.grad is None:
            continue
        seen.add(id(p))
        grad = p.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        norm = torch.linalg.vector_norm(local)
        if isinstance(grad, DTensor):
            norm = _whole(norm, grad.device_mesh.get_group())
        if name in slices:
            norm = _whole(norm, slices[name][1])
        norms["tp layers" if layer in SLICES else "others"].append(norm)
return norms
""",
                'clip_grad_norm_': """\
# TODO (clip_grad_norm_): each group's total: vector_norm of its norms stacked; the total:
# the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:
# squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm / (total
# + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils.clip_grads_with_norm_
# with foreach=False does this: it takes the parameters, and scales their .grad); return
# the total (before clipping).
total = torch.zeros(())
for group_norms in weight_norms(module, mesh).values():
    if group_norms:
        total = total + torch.linalg.vector_norm(torch.stack(group_norms)) ** 2
total = total ** 0.5
if mesh.mesh_dim_names and "pp" in mesh.mesh_dim_names:
    squared = total ** 2
    dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared ** 0.5
torch.nn.utils.clip_grads_with_norm_([p for p in module.parameters() if p.grad is not None],
                                     max_norm, total, foreach=False)
return total
""",
            }),
    },
    'experts': {
        'wrong_counts_splits_in_elements': dict(
            mistake="the counts' all_to_all of a (W, per_rank) tensor given splits in elements",
            ranks=2, alone=False, verdict='named',
            said="splits counted in elements, not rows: all_to_all_single's splits count rows (slices along dim 0)",
            bodies={
                '_AllToAll.backward': """\
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
# each rank gets per_rank counts from every rank
dist.all_to_all_single(theirs, mine, [self.per_rank] * size, [self.per_rank] * size,
                       group=self.group)
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert, stable=True)
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(arrived[order].split(theirs.sum(0).tolist()))]
inverse = torch.argsort(order)
return all_to_all(torch.cat(outs)[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
W = dist.get_world_size()
dp = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
experts = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
           for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) not in experts:
        dist.all_reduce(p.grad)
    elif dp is not None:
        dist.all_reduce(p.grad, group=dp)
    p.grad /= W
""",
            }),
        'wrong_splits_per_expert': dict(
            mistake="the rows' all_to_all given a split per expert (E of them), not one per rank",
            ranks=2, alone=False, verdict='named',
            said="all_to_all_single takes one split per rank of its group (ep = 2): split j is the rows to (or from) rank j; yours gives one per expert",
            bodies={
                '_AllToAll.backward': """\
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
size = dist.get_world_size(self.group)
theirs = torch.empty_like(counts)
dist.all_to_all_single(theirs, counts, group=self.group)
send, recv = counts.tolist(), theirs.tolist()  # a count per expert
arrived = all_to_all(routed, send, recv, self.group)
theirs = theirs.view(size, self.per_rank)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert, stable=True)
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(arrived[order].split(theirs.sum(0).tolist()))]
inverse = torch.argsort(order)
return all_to_all(torch.cat(outs)[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
W = dist.get_world_size()
dp = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
experts = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
           for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) not in experts:
        dist.all_reduce(p.grad)
    elif dp is not None:
        dist.all_reduce(p.grad, group=dp)
    p.grad /= W
""",
            }),
        'wrong_expert_div_dp': dict(
            mistake='expert grads divided by dp, not W',
            ranks=2, alone=False, verdict='named',
            said="2.000x the reference's, expert 2's gradient: not divided by W = 2. An",
            bodies={
                '_AllToAll.backward': """\
# TODO (_AllToAll.backward): the gradient of each row that arrived goes back to the
# rank it came from, in its place: the same all_to_all_single the other way (send and
# recv swapped); None for send, recv and group.
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
# TODO (ExpertsOnRanks.forward): (1) all_to_all the counts: each rank's counts cut in
# runs of per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank
# j sends to my expert e; send[j] = my counts for rank j's experts, recv[j] = what
# rank j sends me; (2) all_to_all the rows with those uneven splits (they arrive
# source-major: rank 0's run for my experts, then rank 1's); (3) regroup them by
# expert, keeping source order within an expert (a stable sort): each expert must see
# its rows in the order (source rank, token), the order one process on the whole batch
# gives it, or its gradient is summed in another order; (4) each local expert on its
# run; (5) the outputs back to source order (the inverse permutation), and home by
# all_to_all (recv and send swapped).
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
dist.all_to_all_single(theirs, mine.contiguous(), group=self.group)  # theirs[j][e]
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert, stable=True)
by_expert = arrived[order]
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(by_expert.split(theirs.sum(0).tolist()))]
out = torch.cat(outs)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(len(order))
return all_to_all(out[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
# TODO (sync_gradients): the replicated weights' gradients (the router): all_reduce (SUM)
# over every rank, then / W; an expert's: all_reduce over the ranks that hold the same
# experts (mesh["dp"]; none with a 1-D mesh, never the ep ranks: they hold other experts),
# then / W as well (not / dp): the loss is the mean of the W ranks' losses, and the
# all_to_all's backward already brought every rank's tokens' part.
W = dist.get_world_size()
dp = mesh["dp"].get_group() if mesh.ndim > 1 and "dp" in mesh.mesh_dim_names else None
expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
                 for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) in expert_params:
        if dp is not None:
            dist.all_reduce(p.grad, group=dp)
            p.grad /= dist.get_world_size(dp)
        continue
    else:
        dist.all_reduce(p.grad)
    p.grad /= W
""",
            }),
        'wrong_expert_reduced_world': dict(
            mistake='expert grads all_reduced over every rank',
            ranks=2, alone=False, verdict='named',
            said="expert 0's gradient is summed over the ep ranks, which hold other",
            bodies={
                '_AllToAll.backward': """\
# TODO (_AllToAll.backward): the gradient of each row that arrived goes back to the
# rank it came from, in its place: the same all_to_all_single the other way (send and
# recv swapped); None for send, recv and group.
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
# TODO (ExpertsOnRanks.forward): (1) all_to_all the counts: each rank's counts cut in
# runs of per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank
# j sends to my expert e; send[j] = my counts for rank j's experts, recv[j] = what
# rank j sends me; (2) all_to_all the rows with those uneven splits (they arrive
# source-major: rank 0's run for my experts, then rank 1's); (3) regroup them by
# expert, keeping source order within an expert (a stable sort): each expert must see
# its rows in the order (source rank, token), the order one process on the whole batch
# gives it, or its gradient is summed in another order; (4) each local expert on its
# run; (5) the outputs back to source order (the inverse permutation), and home by
# all_to_all (recv and send swapped).
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
dist.all_to_all_single(theirs, mine.contiguous(), group=self.group)  # theirs[j][e]
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert, stable=True)
by_expert = arrived[order]
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(by_expert.split(theirs.sum(0).tolist()))]
out = torch.cat(outs)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(len(order))
return all_to_all(out[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
# TODO (sync_gradients): the replicated weights' gradients (the router): all_reduce (SUM)
# over every rank, then / W; an expert's: all_reduce over the ranks that hold the same
# experts (mesh["dp"]; none with a 1-D mesh, never the ep ranks: they hold other experts),
# then / W as well (not / dp): the loss is the mean of the W ranks' losses, and the
# all_to_all's backward already brought every rank's tokens' part.
W = dist.get_world_size()
dp = mesh["dp"].get_group() if mesh.ndim > 1 and "dp" in mesh.mesh_dim_names else None
expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
                 for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    dist.all_reduce(p.grad)
    p.grad /= W
""",
            }),
        'wrong_no_inverse': dict(
            mistake='outputs permuted by `order` instead of its inverse',
            ranks=2, alone=False, verdict='named',
            said="every expert was given the reference's rows in the reference's order,",
            bodies={
                '_AllToAll.backward': """\
# TODO (_AllToAll.backward): the gradient of each row that arrived goes back to the
# rank it came from, in its place: the same all_to_all_single the other way (send and
# recv swapped); None for send, recv and group.
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
# TODO (ExpertsOnRanks.forward): (1) all_to_all the counts: each rank's counts cut in
# runs of per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank
# j sends to my expert e; send[j] = my counts for rank j's experts, recv[j] = what
# rank j sends me; (2) all_to_all the rows with those uneven splits (they arrive
# source-major: rank 0's run for my experts, then rank 1's); (3) regroup them by
# expert, keeping source order within an expert (a stable sort): each expert must see
# its rows in the order (source rank, token), the order one process on the whole batch
# gives it, or its gradient is summed in another order; (4) each local expert on its
# run; (5) the outputs back to source order (the inverse permutation), and home by
# all_to_all (recv and send swapped).
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
dist.all_to_all_single(theirs, mine.contiguous(), group=self.group)  # theirs[j][e]
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert, stable=True)
by_expert = arrived[order]
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(by_expert.split(theirs.sum(0).tolist()))]
out = torch.cat(outs)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(len(order))
return all_to_all(out[order], recv, send, self.group)
""",
                'sync_gradients': """\
# TODO (sync_gradients): the replicated weights' gradients (the router): all_reduce (SUM)
# over every rank, then / W; an expert's: all_reduce over the ranks that hold the same
# experts (mesh["dp"]; none with a 1-D mesh, never the ep ranks: they hold other experts),
# then / W as well (not / dp): the loss is the mean of the W ranks' losses, and the
# all_to_all's backward already brought every rank's tokens' part.
W = dist.get_world_size()
dp = mesh["dp"].get_group() if mesh.ndim > 1 and "dp" in mesh.mesh_dim_names else None
expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
                 for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) in expert_params:
        if dp is not None:
            dist.all_reduce(p.grad, group=dp)
    else:
        dist.all_reduce(p.grad)
    p.grad /= W
""",
            }),
        'wrong_recv_per_expert': dict(
            mistake="arrived rows' expert ids laid out expert-major (theirs.t())",
            ranks=2, alone=False, verdict='named',
            said="expert 2 (on rank 0) got other rows than one process's: its row 1 is",
            bodies={
                '_AllToAll.backward': """\
# TODO (_AllToAll.backward): the gradient of each row that arrived goes back to the
# rank it came from, in its place: the same all_to_all_single the other way (send and
# recv swapped); None for send, recv and group.
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
# TODO (ExpertsOnRanks.forward): (1) all_to_all the counts: each rank's counts cut in
# runs of per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank
# j sends to my expert e; send[j] = my counts for rank j's experts, recv[j] = what
# rank j sends me; (2) all_to_all the rows with those uneven splits (they arrive
# source-major: rank 0's run for my experts, then rank 1's); (3) regroup them by
# expert, keeping source order within an expert (a stable sort): each expert must see
# its rows in the order (source rank, token), the order one process on the whole batch
# gives it, or its gradient is summed in another order; (4) each local expert on its
# run; (5) the outputs back to source order (the inverse permutation), and home by
# all_to_all (recv and send swapped).
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
dist.all_to_all_single(theirs, mine.contiguous(), group=self.group)  # theirs[j][e]
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.t().flatten())
order = torch.argsort(expert, stable=True)
by_expert = arrived[order]
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(by_expert.split(theirs.sum(0).tolist()))]
out = torch.cat(outs)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(len(order))
return all_to_all(out[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
# TODO (sync_gradients): the replicated weights' gradients (the router): all_reduce (SUM)
# over every rank, then / W; an expert's: all_reduce over the ranks that hold the same
# experts (mesh["dp"]; none with a 1-D mesh, never the ep ranks: they hold other experts),
# then / W as well (not / dp): the loss is the mean of the W ranks' losses, and the
# all_to_all's backward already brought every rank's tokens' part.
W = dist.get_world_size()
dp = mesh["dp"].get_group() if mesh.ndim > 1 and "dp" in mesh.mesh_dim_names else None
expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
                 for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) in expert_params:
        if dp is not None:
            dist.all_reduce(p.grad, group=dp)
    else:
        dist.all_reduce(p.grad)
    p.grad /= W
""",
            }),
        'wrong_router_not_divided': dict(
            mistake='replicated router grad not divided by W',
            ranks=2, alone=False, verdict='named',
            said="2.000x the reference's, the replicated weights (router.weight): their",
            bodies={
                '_AllToAll.backward': """\
# TODO (_AllToAll.backward): the gradient of each row that arrived goes back to the
# rank it came from, in its place: the same all_to_all_single the other way (send and
# recv swapped); None for send, recv and group.
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
# TODO (ExpertsOnRanks.forward): (1) all_to_all the counts: each rank's counts cut in
# runs of per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank
# j sends to my expert e; send[j] = my counts for rank j's experts, recv[j] = what
# rank j sends me; (2) all_to_all the rows with those uneven splits (they arrive
# source-major: rank 0's run for my experts, then rank 1's); (3) regroup them by
# expert, keeping source order within an expert (a stable sort): each expert must see
# its rows in the order (source rank, token), the order one process on the whole batch
# gives it, or its gradient is summed in another order; (4) each local expert on its
# run; (5) the outputs back to source order (the inverse permutation), and home by
# all_to_all (recv and send swapped).
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
dist.all_to_all_single(theirs, mine.contiguous(), group=self.group)  # theirs[j][e]
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert, stable=True)
by_expert = arrived[order]
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(by_expert.split(theirs.sum(0).tolist()))]
out = torch.cat(outs)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(len(order))
return all_to_all(out[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
# TODO (sync_gradients): the replicated weights' gradients (the router): all_reduce (SUM)
# over every rank, then / W; an expert's: all_reduce over the ranks that hold the same
# experts (mesh["dp"]; none with a 1-D mesh, never the ep ranks: they hold other experts),
# then / W as well (not / dp): the loss is the mean of the W ranks' losses, and the
# all_to_all's backward already brought every rank's tokens' part.
W = dist.get_world_size()
dp = mesh["dp"].get_group() if mesh.ndim > 1 and "dp" in mesh.mesh_dim_names else None
expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
                 for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) in expert_params:
        if dp is not None:
            dist.all_reduce(p.grad, group=dp)
        p.grad /= W
    else:
        dist.all_reduce(p.grad)
""",
            }),
        'wrong_unstable_sort': dict(
            mistake='argsort without stable=True',
            ranks=4, alone=False, verdict='named',
            said='expert 4 (on rank 2) got the right 13 rows in another order: its row',
            bodies={
                '_AllToAll.backward': """\
# TODO (_AllToAll.backward): the gradient of each row that arrived goes back to the
# rank it came from, in its place: the same all_to_all_single the other way (send and
# recv swapped); None for send, recv and group.
send, recv, group = ctx.how
back = grad.new_empty(sum(send), *grad.shape[1:])
dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
return back, None, None, None
""",
                'ExpertsOnRanks.forward': """\
# TODO (ExpertsOnRanks.forward): (1) all_to_all the counts: each rank's counts cut in
# runs of per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank
# j sends to my expert e; send[j] = my counts for rank j's experts, recv[j] = what
# rank j sends me; (2) all_to_all the rows with those uneven splits (they arrive
# source-major: rank 0's run for my experts, then rank 1's); (3) regroup them by
# expert, keeping source order within an expert (a stable sort): each expert must see
# its rows in the order (source rank, token), the order one process on the whole batch
# gives it, or its gradient is summed in another order; (4) each local expert on its
# run; (5) the outputs back to source order (the inverse permutation), and home by
# all_to_all (recv and send swapped).
size = dist.get_world_size(self.group)
mine = counts.reshape(size, self.per_rank)
theirs = torch.empty_like(mine)
dist.all_to_all_single(theirs, mine.contiguous(), group=self.group)  # theirs[j][e]
send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
arrived = all_to_all(routed, send, recv, self.group)
expert = torch.arange(self.per_rank).repeat(size).repeat_interleave(theirs.flatten())
order = torch.argsort(expert)
by_expert = arrived[order]
outs = [self.mlps[str(self.first + e)](run)
        for e, run in enumerate(by_expert.split(theirs.sum(0).tolist()))]
out = torch.cat(outs)
inverse = torch.empty_like(order)
inverse[order] = torch.arange(len(order))
return all_to_all(out[inverse], recv, send, self.group)
""",
                'sync_gradients': """\
# TODO (sync_gradients): the replicated weights' gradients (the router): all_reduce (SUM)
# over every rank, then / W; an expert's: all_reduce over the ranks that hold the same
# experts (mesh["dp"]; none with a 1-D mesh, never the ep ranks: they hold other experts),
# then / W as well (not / dp): the loss is the mean of the W ranks' losses, and the
# all_to_all's backward already brought every rank's tokens' part.
W = dist.get_world_size()
dp = mesh["dp"].get_group() if mesh.ndim > 1 and "dp" in mesh.mesh_dim_names else None
expert_params = {id(p) for m in model.modules() if isinstance(m, ExpertsOnRanks)
                 for p in m.parameters()}
for p in model.parameters():
    if p.grad is None:
        continue
    if id(p) in expert_params:
        if dp is not None:
            dist.all_reduce(p.grad, group=dp)
    else:
        dist.all_reduce(p.grad)
    p.grad /= W
""",
            }),
    },
    'fsdp': {
        'w_plain_grads': dict(
            mistake='reduce_scatter returns plain tensors, not DTensors',
            ranks=1, alone=True, verdict='named',
            said='got mixed torch.Tensor and DTensor',
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        block = torch.zeros(p.block_numel, dtype=local.dtype, device=local.device)
        block[:local.numel()] = local  # the last blocks may be short: pad to rows
        mine.append(block)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
                'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
offset = 0
for p, g in zip(params, grads):
    padded = torch.zeros(ws * p.rows, *g.shape[1:], dtype=g.dtype, device=g.device)
    padded[:g.shape[0]] = g
    flat[:, offset:offset + p.block_numel] = padded.reshape(ws, p.block_numel)
    offset += p.block_numel
out = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.AVG, group=self.group)
blocks, offset = [], 0
for p, g in zip(params, grads):
    mine = out[offset:offset + p.block_numel].view(p.rows, *g.shape[1:])
    start = min(self.rank * p.rows, g.shape[0])
    n = max(0, min(p.rows, g.shape[0] - start))
    blocks.append(mine[:n].clone())
    offset += p.block_numel
return blocks
""",
            }),
        'w_rs_floor_split': dict(
            mistake="rows split floor-style (r*n//ws) not torch.chunk's ceil blocks",
            ranks=2, alone=True, verdict='named',
            said="a gradient and its parameter's shard differ in rows",
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        block = torch.zeros(p.block_numel, dtype=local.dtype, device=local.device)
        block[:local.numel()] = local  # the last blocks may be short: pad to rows
        mine.append(block)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
                'Unit.reduce_scatter': """\
# the other right way: all_reduce each whole gradient, average, keep our rows
blocks = []
for p, g in zip(params, grads):
    total = g.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
    total /= self.world_size
    start = self.rank * g.shape[0] // self.world_size
    stop = (self.rank + 1) * g.shape[0] // self.world_size
    blocks.append(self.as_dtensor(total[start:stop].clone(), p.full))
return blocks
""",
            }),
        'w_rs_no_trim': dict(
            mistake='padded (untrimmed) block returned for the short last rank',
            ranks=2, alone=True, verdict='named',
            said="a gradient and its parameter's shard differ in rows",
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        block = torch.zeros(p.block_numel, dtype=local.dtype, device=local.device)
        block[:local.numel()] = local  # the last blocks may be short: pad to rows
        mine.append(block)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
                'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
offset = 0
for p, g in zip(params, grads):
    padded = torch.zeros(ws * p.rows, *g.shape[1:], dtype=g.dtype, device=g.device)
    padded[:g.shape[0]] = g
    flat[:, offset:offset + p.block_numel] = padded.reshape(ws, p.block_numel)
    offset += p.block_numel
out = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.AVG, group=self.group)
blocks, offset = [], 0
for p, g in zip(params, grads):
    mine = out[offset:offset + p.block_numel].view(p.rows, *g.shape[1:])
    start = min(self.rank * p.rows, g.shape[0])
    n = max(0, min(p.rows, g.shape[0] - start))
    blocks.append(self.as_dtensor(mine.clone(), p.full))
    offset += p.block_numel
return blocks
""",
            }),
        'w_rs_sum': dict(
            mistake='reduce_scatter SUM, no average',
            ranks=2, alone=False, verdict='named',
            said="2.000x stock's, every gradient: summed, not averaged: divide by the",
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        block = torch.zeros(p.block_numel, dtype=local.dtype, device=local.device)
        block[:local.numel()] = local  # the last blocks may be short: pad to rows
        mine.append(block)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
                'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
offset = 0
for p, g in zip(params, grads):
    padded = torch.zeros(ws * p.rows, *g.shape[1:], dtype=g.dtype, device=g.device)
    padded[:g.shape[0]] = g
    flat[:, offset:offset + p.block_numel] = padded.reshape(ws, p.block_numel)
    offset += p.block_numel
out = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.SUM, group=self.group)
blocks, offset = [], 0
for p, g in zip(params, grads):
    mine = out[offset:offset + p.block_numel].view(p.rows, *g.shape[1:])
    start = min(self.rank * p.rows, g.shape[0])
    n = max(0, min(p.rows, g.shape[0] - start))
    blocks.append(self.as_dtensor(mine[:n].clone(), p.full))
    offset += p.block_numel
return blocks
""",
            }),
        'w_unshard_bumps_version': dict(
            mistake='unshard fills p.full with p.full.copy_ (bumps the version autograd saved)',
            ranks=1, alone=True, verdict='named',
            said='changed in place after the forward used it',
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        block = torch.zeros(p.block_numel, dtype=local.dtype, device=local.device)
        block[:local.numel()] = local  # the last blocks may be short: pad to rows
        mine.append(block)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
                'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
offset = 0
for p, g in zip(params, grads):
    padded = torch.zeros(ws * p.rows, *g.shape[1:], dtype=g.dtype, device=g.device)
    padded[:g.shape[0]] = g
    flat[:, offset:offset + p.block_numel] = padded.reshape(ws, p.block_numel)
    offset += p.block_numel
out = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.AVG, group=self.group)
blocks, offset = [], 0
for p, g in zip(params, grads):
    mine = out[offset:offset + p.block_numel].view(p.rows, *g.shape[1:])
    start = min(self.rank * p.rows, g.shape[0])
    n = max(0, min(p.rows, g.shape[0] - start))
    blocks.append(self.as_dtensor(mine[:n].clone(), p.full))
    offset += p.block_numel
return blocks
""",
            }),
        'w_unshard_no_flag': dict(
            mistake='unshard never sets is_unsharded=True',
            ranks=1, alone=True, verdict='named',
            said='unshard ran again on weights already whole',
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        block = torch.zeros(p.block_numel, dtype=local.dtype, device=local.device)
        block[:local.numel()] = local  # the last blocks may be short: pad to rows
        mine.append(block)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
""",
                'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
offset = 0
for p, g in zip(params, grads):
    padded = torch.zeros(ws * p.rows, *g.shape[1:], dtype=g.dtype, device=g.device)
    padded[:g.shape[0]] = g
    flat[:, offset:offset + p.block_numel] = padded.reshape(ws, p.block_numel)
    offset += p.block_numel
out = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.AVG, group=self.group)
blocks, offset = [], 0
for p, g in zip(params, grads):
    mine = out[offset:offset + p.block_numel].view(p.rows, *g.shape[1:])
    start = min(self.rank * p.rows, g.shape[0])
    n = max(0, min(p.rows, g.shape[0] - start))
    blocks.append(self.as_dtensor(mine[:n].clone(), p.full))
    offset += p.block_numel
return blocks
""",
            }),
        'w_unshard_no_pad': dict(
            mistake='short blocks not padded before all_gather',
            ranks=2, alone=True, verdict='named', hangs=True,
            said='every rank waits in all_gather, called with other tensor sizes',
            bodies={
                'Unit.unshard': """\
if self.is_unsharded:
    return
if self.params:
    ws = self.world_size
    mine = []
    for p in self.params:
        local = p.shard.to_local().reshape(-1)
        mine.append(local)
    send = torch.cat(mine)
    recv = [torch.empty_like(send) for _ in range(ws)]  # every rank's blocks as big as mine
    dist.all_gather(recv, send, group=self.group)
    gathered = torch.stack(recv)  # row r: rank r's blocks
    offset = 0
    for p in self.params:
        rows = gathered[:, offset:offset + p.block_numel].reshape(ws * p.rows, *p.full.shape[1:])
        p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        p.full.data.copy_(rows[:p.full.shape[0]])
        p.show(p.full)
        offset += p.block_numel
self.is_unsharded = True
""",
                'Unit.reduce_scatter': """\
ws = self.world_size
per_rank = sum(p.block_numel for p in params)
flat = torch.zeros(ws, per_rank, dtype=grads[0].dtype, device=grads[0].device)
offset = 0
for p, g in zip(params, grads):
    padded = torch.zeros(ws * p.rows, *g.shape[1:], dtype=g.dtype, device=g.device)
    padded[:g.shape[0]] = g
    flat[:, offset:offset + p.block_numel] = padded.reshape(ws, p.block_numel)
    offset += p.block_numel
out = torch.empty(per_rank, dtype=flat.dtype, device=flat.device)
dist.reduce_scatter_tensor(out, flat.reshape(-1), op=dist.ReduceOp.AVG, group=self.group)
blocks, offset = [], 0
for p, g in zip(params, grads):
    mine = out[offset:offset + p.block_numel].view(p.rows, *g.shape[1:])
    start = min(self.rank * p.rows, g.shape[0])
    n = max(0, min(p.rows, g.shape[0] - start))
    blocks.append(self.as_dtensor(mine[:n].clone(), p.full))
    offset += p.block_numel
return blocks
""",
            }),
    },
    'interleaved': {
        'wrong_bwd_not_reversed': dict(
            mistake="backwards' local stage not reversed",
            ranks=2, alone=False, verdict='named',
            said="the backwards' stages: stock's backward number 0 runs at stage 2,",
            bodies={
                'interleaved_1f1b': """\
# TODO (interleaved_1f1b): rank `rank`'s list of actions "sFi" (stage s, F or B,
# microbatch i; None slots, the waits, are allowed anywhere and not graded), its stages
# rank, rank + pp, ...: per_round = rounds(pp, n) (n // max(1, n // pp)); warmup =
# min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local) forwards; the op-th
# forward (op = 0, 1, ... n * n_local - 1) at local stage (op // per_round) % n_local,
# stage local * pp + rank; then for op = warmup ... warmup + n * n_local - 1: the forward
# op (while op < n * n_local), then a backward at local stage n_local - 1 - ((op - warmup)
# // per_round) % n_local; each stage numbers its own forwards 0, 1, ... and its own
# backwards 0, 1, .... zero_bubble=True: 1 per hop, not 2, in the warm-up; each B written
# I (the input's gradient); after the I of op, once op - warmup >= rank, a W (the weights'
# gradient) of the oldest I without its W (same stage and microbatch); at the end the Ws
# left, in the I's order.
per_round = rounds(pp, n)
total = n * n_local
hop = 1 if zero_bubble else 2
warmup = min((n_local - 1) * per_round + hop * (pp - 1 - rank), total)
f_seen, b_seen = {}, {}

def forward(op):
    local = (op // per_round) % n_local
    s = local * pp + rank
    i = f_seen.get(s, 0)
    f_seen[s] = i + 1
    return _action(s, "F", i)

def backward(op):
    local = ((op - warmup) // per_round) % n_local
    s = local * pp + rank
    i = b_seen.get(s, 0)
    b_seen[s] = i + 1
    return s, i

actions = [None] * rank
for op in range(warmup):
    actions.append(forward(op))
waiting = []  # the Is without their W, oldest first
for op in range(warmup, warmup + total):
    if op < total:
        actions.append(forward(op))
    s, i = backward(op)
    if zero_bubble:
        actions.append(_action(s, "I", i))
        waiting.append((s, i))
        if op - warmup >= rank:
            s_w, i_w = waiting.pop(0)
            actions.append(_action(s_w, "W", i_w))
    else:
        actions.append(_action(s, "B", i))
actions += [_action(s, "W", i) for s, i in waiting]
return actions
""",
            }),
        'wrong_contiguous_stages': dict(
            mistake='stage rank*n_local+local (contiguous placement, not loop)',
            ranks=2, alone=False, verdict='named',
            said="actions missing or repeated (2F0 (stage 2's forward of microbatch 0)",
            bodies={
                'interleaved_1f1b': """\
# TODO (interleaved_1f1b): rank `rank`'s list of actions "sFi" (stage s, F or B,
# microbatch i; None slots, the waits, are allowed anywhere and not graded), its stages
# rank, rank + pp, ...: per_round = rounds(pp, n) (n // max(1, n // pp)); warmup =
# min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local) forwards; the op-th
# forward (op = 0, 1, ... n * n_local - 1) at local stage (op // per_round) % n_local,
# stage local * pp + rank; then for op = warmup ... warmup + n * n_local - 1: the forward
# op (while op < n * n_local), then a backward at local stage n_local - 1 - ((op - warmup)
# // per_round) % n_local; each stage numbers its own forwards 0, 1, ... and its own
# backwards 0, 1, .... zero_bubble=True: 1 per hop, not 2, in the warm-up; each B written
# I (the input's gradient); after the I of op, once op - warmup >= rank, a W (the weights'
# gradient) of the oldest I without its W (same stage and microbatch); at the end the Ws
# left, in the I's order.
per_round = rounds(pp, n)
total = n * n_local
hop = 1 if zero_bubble else 2
warmup = min((n_local - 1) * per_round + hop * (pp - 1 - rank), total)
f_seen, b_seen = {}, {}

def forward(op):
    local = (op // per_round) % n_local
    s = rank * n_local + local
    i = f_seen.get(s, 0)
    f_seen[s] = i + 1
    return _action(s, "F", i)

def backward(op):
    local = n_local - 1 - ((op - warmup) // per_round) % n_local
    s = rank * n_local + local
    i = b_seen.get(s, 0)
    b_seen[s] = i + 1
    return s, i

actions = [None] * rank
for op in range(warmup):
    actions.append(forward(op))
waiting = []  # the Is without their W, oldest first
for op in range(warmup, warmup + total):
    if op < total:
        actions.append(forward(op))
    s, i = backward(op)
    if zero_bubble:
        actions.append(_action(s, "I", i))
        waiting.append((s, i))
        if op - warmup >= rank:
            s_w, i_w = waiting.pop(0)
            actions.append(_action(s_w, "W", i_w))
    else:
        actions.append(_action(s, "B", i))
actions += [_action(s, "W", i) for s, i in waiting]
return actions
""",
            }),
        'wrong_per_round': dict(
            mistake='per_round = max(1, n//pp) instead of rounds()',
            ranks=2, alone=False, verdict='named',
            said="the forwards' stages: stock's forward number 1 runs at stage 0, yours",
            bodies={
                'interleaved_1f1b': """\
# TODO (interleaved_1f1b): rank `rank`'s list of actions "sFi" (stage s, F or B,
# microbatch i; None slots, the waits, are allowed anywhere and not graded), its stages
# rank, rank + pp, ...: per_round = rounds(pp, n) (n // max(1, n // pp)); warmup =
# min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local) forwards; the op-th
# forward (op = 0, 1, ... n * n_local - 1) at local stage (op // per_round) % n_local,
# stage local * pp + rank; then for op = warmup ... warmup + n * n_local - 1: the forward
# op (while op < n * n_local), then a backward at local stage n_local - 1 - ((op - warmup)
# // per_round) % n_local; each stage numbers its own forwards 0, 1, ... and its own
# backwards 0, 1, .... zero_bubble=True: 1 per hop, not 2, in the warm-up; each B written
# I (the input's gradient); after the I of op, once op - warmup >= rank, a W (the weights'
# gradient) of the oldest I without its W (same stage and microbatch); at the end the Ws
# left, in the I's order.
per_round = max(1, n // pp)
total = n * n_local
hop = 1 if zero_bubble else 2
warmup = min((n_local - 1) * per_round + hop * (pp - 1 - rank), total)
f_seen, b_seen = {}, {}

def forward(op):
    local = (op // per_round) % n_local
    s = local * pp + rank
    i = f_seen.get(s, 0)
    f_seen[s] = i + 1
    return _action(s, "F", i)

def backward(op):
    local = n_local - 1 - ((op - warmup) // per_round) % n_local
    s = local * pp + rank
    i = b_seen.get(s, 0)
    b_seen[s] = i + 1
    return s, i

actions = [None] * rank
for op in range(warmup):
    actions.append(forward(op))
waiting = []  # the Is without their W, oldest first
for op in range(warmup, warmup + total):
    if op < total:
        actions.append(forward(op))
    s, i = backward(op)
    if zero_bubble:
        actions.append(_action(s, "I", i))
        waiting.append((s, i))
        if op - warmup >= rank:
            s_w, i_w = waiting.pop(0)
            actions.append(_action(s_w, "W", i_w))
    else:
        actions.append(_action(s, "B", i))
actions += [_action(s, "W", i) for s, i in waiting]
return actions
""",
            }),
        'wrong_warmup_hops': dict(
            mistake='warm-up 2*(pp-rank) instead of 2*(pp-1-rank)',
            ranks=2, alone=False, verdict='named',
            said="the warm-up: stock's rank 1 runs 3 forwards before its first",
            bodies={
                'interleaved_1f1b': """\
# TODO (interleaved_1f1b): rank `rank`'s list of actions "sFi" (stage s, F or B,
# microbatch i; None slots, the waits, are allowed anywhere and not graded), its stages
# rank, rank + pp, ...: per_round = rounds(pp, n) (n // max(1, n // pp)); warmup =
# min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local) forwards; the op-th
# forward (op = 0, 1, ... n * n_local - 1) at local stage (op // per_round) % n_local,
# stage local * pp + rank; then for op = warmup ... warmup + n * n_local - 1: the forward
# op (while op < n * n_local), then a backward at local stage n_local - 1 - ((op - warmup)
# // per_round) % n_local; each stage numbers its own forwards 0, 1, ... and its own
# backwards 0, 1, .... zero_bubble=True: 1 per hop, not 2, in the warm-up; each B written
# I (the input's gradient); after the I of op, once op - warmup >= rank, a W (the weights'
# gradient) of the oldest I without its W (same stage and microbatch); at the end the Ws
# left, in the I's order.
per_round = rounds(pp, n)
total = n * n_local
hop = 1 if zero_bubble else 2
warmup = min((n_local - 1) * per_round + hop * (pp - rank), total)
f_seen, b_seen = {}, {}

def forward(op):
    local = (op // per_round) % n_local
    s = local * pp + rank
    i = f_seen.get(s, 0)
    f_seen[s] = i + 1
    return _action(s, "F", i)

def backward(op):
    local = n_local - 1 - ((op - warmup) // per_round) % n_local
    s = local * pp + rank
    i = b_seen.get(s, 0)
    b_seen[s] = i + 1
    return s, i

actions = [None] * rank
for op in range(warmup):
    actions.append(forward(op))
waiting = []  # the Is without their W, oldest first
for op in range(warmup, warmup + total):
    if op < total:
        actions.append(forward(op))
    s, i = backward(op)
    if zero_bubble:
        actions.append(_action(s, "I", i))
        waiting.append((s, i))
        if op - warmup >= rank:
            s_w, i_w = waiting.pop(0)
            actions.append(_action(s_w, "W", i_w))
    else:
        actions.append(_action(s, "B", i))
actions += [_action(s, "W", i) for s, i in waiting]
return actions
""",
            }),
        'wrong_warmup_no_local': dict(
            mistake='warm-up n_local*per_round (not n_local-1)',
            ranks=2, alone=False, verdict='named',
            said="the warm-up: stock's rank 1 runs 3 forwards before its first",
            bodies={
                'interleaved_1f1b': """\
# TODO (interleaved_1f1b): rank `rank`'s list of actions "sFi" (stage s, F or B,
# microbatch i; None slots, the waits, are allowed anywhere and not graded), its stages
# rank, rank + pp, ...: per_round = rounds(pp, n) (n // max(1, n // pp)); warmup =
# min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local) forwards; the op-th
# forward (op = 0, 1, ... n * n_local - 1) at local stage (op // per_round) % n_local,
# stage local * pp + rank; then for op = warmup ... warmup + n * n_local - 1: the forward
# op (while op < n * n_local), then a backward at local stage n_local - 1 - ((op - warmup)
# // per_round) % n_local; each stage numbers its own forwards 0, 1, ... and its own
# backwards 0, 1, .... zero_bubble=True: 1 per hop, not 2, in the warm-up; each B written
# I (the input's gradient); after the I of op, once op - warmup >= rank, a W (the weights'
# gradient) of the oldest I without its W (same stage and microbatch); at the end the Ws
# left, in the I's order.
per_round = rounds(pp, n)
total = n * n_local
hop = 1 if zero_bubble else 2
warmup = min(n_local * per_round + hop * (pp - 1 - rank), total)
f_seen, b_seen = {}, {}

def forward(op):
    local = (op // per_round) % n_local
    s = local * pp + rank
    i = f_seen.get(s, 0)
    f_seen[s] = i + 1
    return _action(s, "F", i)

def backward(op):
    local = n_local - 1 - ((op - warmup) // per_round) % n_local
    s = local * pp + rank
    i = b_seen.get(s, 0)
    b_seen[s] = i + 1
    return s, i

actions = [None] * rank
for op in range(warmup):
    actions.append(forward(op))
waiting = []  # the Is without their W, oldest first
for op in range(warmup, warmup + total):
    if op < total:
        actions.append(forward(op))
    s, i = backward(op)
    if zero_bubble:
        actions.append(_action(s, "I", i))
        waiting.append((s, i))
        if op - warmup >= rank:
            s_w, i_w = waiting.pop(0)
            actions.append(_action(s_w, "W", i_w))
    else:
        actions.append(_action(s, "B", i))
actions += [_action(s, "W", i) for s, i in waiting]
return actions
""",
            }),
    },
    'mesh': {
        'w_colmajor_coord': dict(
            mistake='column-major coordinate',
            ranks=2, alone=False, verdict='named',
            said="column-major: your first dimension varies fastest; stock's grid is",
            bodies={
                'grid_groups': """\
mesh = torch.arange(math.prod(shape)).reshape(shape)
lines = mesh.movedim(dim, -1).reshape(-1, shape[dim])
return [line.tolist() for line in lines]
""",
                'grid_coordinate': """\
coordinate = []
for size in shape:  # first dimension fastest
    coordinate.append(rank % size)
    rank //= size
return coordinate
""",
            }),
        'w_coord_no_mod': dict(
            mistake='coordinate without % shape[d]',
            ranks=2, alone=False, verdict='named',
            said="rank 1 sits at [1, 0] in stock's row-major grid: index d is rank //",
            bodies={
                'grid_groups': """\
mesh = torch.arange(math.prod(shape)).reshape(shape)
lines = mesh.movedim(dim, -1).reshape(-1, shape[dim])
return [line.tolist() for line in lines]
""",
                'grid_coordinate': """\
return [rank // math.prod(shape[d + 1:]) for d in range(len(shape))]
""",
            }),
        'w_dim_from_end': dict(
            mistake='dimension counted from the end',
            ranks=2, alone=False, verdict='named',
            said="stock's groups along dimension 1, not 0: a group along dimension 0",
            bodies={
                'grid_groups': """\
mesh = torch.arange(math.prod(shape)).reshape(shape)
d = len(shape) - 1 - dim  # counted from the fastest dimension
lines = mesh.movedim(d, -1).reshape(-1, shape[d])
return [line.tolist() for line in lines]
""",
                'grid_coordinate': """\
coordinate = []
for size in reversed(shape):
    coordinate.append(rank % size)
    rank //= size
return coordinate[::-1]
""",
            }),
        'w_groups_no_move': dict(
            mistake='reshape(-1, shape[dim]) without moving dim last',
            ranks=2, alone=False, verdict='named',
            said='blocks of 2 consecutive ranks, at every dimension: consecutive ranks',
            bodies={
                'grid_groups': """\
mesh = torch.arange(math.prod(shape)).reshape(shape)
return mesh.reshape(-1, shape[dim]).tolist()
""",
                'grid_coordinate': """\
coordinate = []
for size in reversed(shape):
    coordinate.append(rank % size)
    rank //= size
return coordinate[::-1]
""",
            }),
        'w_groups_reversed': dict(
            mistake='each group listed in reverse order',
            ranks=2, alone=False, verdict='named',
            said='the right ranks, in another order within a group: along dimension 0 a',
            bodies={
                'grid_groups': """\
mesh = torch.arange(math.prod(shape)).reshape(shape)
lines = mesh.movedim(dim, -1).reshape(-1, shape[dim])
return [line.flip(0).tolist() for line in lines]
""",
                'grid_coordinate': """\
coordinate = []
for size in reversed(shape):
    coordinate.append(rank % size)
    rank //= size
return coordinate[::-1]
""",
            }),
    },
    'naive': {
        'w_global_world': dict(
            mistake='divides by dist.get_world_size() (global) not the process_group size',
            ranks=3, alone=False, verdict='named',
            said="0.667x stock's: divided by the whole world's size (3), not the",
            bodies={
                'NaiveDDP._average_gradient': """\
if not self._sync_this_backward or param.grad is None:
    return
if not self._arrived:
    at_end_of_backward(self._end_of_backward)
self._arrived.add(id(param))
param.grad.mul_(1.0 / dist.get_world_size())
chosen.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
""",
            }),
        'w_ignore_nosync': dict(
            mistake='ignores _sync_this_backward (communicates in no_sync)',
            ranks=2, alone=False, verdict='named',
            said="a backward inside no_sync() communicated: stock's makes no collective",
            bodies={
                'NaiveDDP._average_gradient': """\
if param.grad is None:
    return
if not self._arrived:
    at_end_of_backward(self._end_of_backward)
self._arrived.add(id(param))
param.grad.mul_(1.0 / self.world_size)
chosen.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
""",
            }),
        'w_no_div': dict(
            mistake='no division by world size',
            ranks=2, alone=False, verdict='named',
            said="2.000x stock's, every gradient: summed, not averaged: divide by the",
            bodies={
                'NaiveDDP._average_gradient': """\
if not self._sync_this_backward or param.grad is None:
    return
if not self._arrived:
    at_end_of_backward(self._end_of_backward)
self._arrived.add(id(param))
chosen.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
""",
            }),
        'w_no_end_check': dict(
            mistake='never registers at_end_of_backward / never notes arrivals (missing-gradient check gone, _sync flag never cleared)',
            ranks=1, alone=False, verdict='named',
            said='got no gradient, and yours trained on',
            bodies={
                'NaiveDDP._average_gradient': """\
if not self._sync_this_backward or param.grad is None:
    return
param.grad.mul_(1.0 / self.world_size)
chosen.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
""",
            }),
        'w_no_group': dict(
            mistake='all_reduce without group=self.process_group',
            ranks=3, alone=True, verdict='named', hangs=True,
            said='on the whole world (no group= given), which rank 0, outside the group, never joins',
            bodies={
                'NaiveDDP._average_gradient': """\
if not self._sync_this_backward or param.grad is None:
    return
if not self._arrived:
    at_end_of_backward(self._end_of_backward)
self._arrived.add(id(param))
param.grad.mul_(1.0 / self.world_size)
chosen.all_reduce(param.grad, op=dist.ReduceOp.SUM)
""",
            }),
        'w_reduce_copy': dict(
            mistake='all_reduce on a clone, never written back to .grad',
            ranks=2, alone=False, verdict='named',
            said="rank 1's gradients differ from rank 0's, where stock's are the same",
            bodies={
                'NaiveDDP._average_gradient': """\
if not self._sync_this_backward or param.grad is None:
    return
if not self._arrived:
    at_end_of_backward(self._end_of_backward)
self._arrived.add(id(param))
grad = param.grad.clone()
grad.mul_(1.0 / self.world_size)
chosen.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)
""",
            }),
    },
    'pp': {
        'wrong_cooldown_reversed': dict(
            mistake='cool-down backwards newest first',
            ranks=2, alone=False, verdict='named',
            said='after a right warm-up of 2 forwards, the steady state: stock runs one',
            bodies={
                'one_f_one_b': """\
# TODO (one_f_one_b): the list of ("F", i) and ("B", i) actions of stage stage_index: a
# warm-up of forwards, then one backward and one forward in turn, then the backwards left.
warmup = min(n, num_stages - stage_index)
actions = [("F", i) for i in range(warmup)]
f, b = warmup, 0
while f < n:
    actions.append(("B", b)); b += 1
    actions.append(("F", f)); f += 1
actions += [("B", i) for i in reversed(range(b, n))]
return actions
""",
            }),
        'wrong_no_min': dict(
            mistake='warm-up not capped at n',
            ranks=3, alone=False, verdict='named',
            said="actions missing or repeated (F2): every microbatch's F and B once",
            bodies={
                'one_f_one_b': """\
# TODO (one_f_one_b): the list of ("F", i) and ("B", i) actions of stage stage_index: a
# warm-up of forwards, then one backward and one forward in turn, then the backwards left.
warmup = num_stages - stage_index
actions = [("F", i) for i in range(warmup)]
f, b = warmup, 0
while f < n:
    actions.append(("B", b)); b += 1
    actions.append(("F", f)); f += 1
actions += [("B", i) for i in range(b, n)]
return actions
""",
            }),
        'wrong_steady_FB': dict(
            mistake='stock warm-up, but steady state F before B',
            ranks=2, alone=False, verdict='named',
            said="the warm-up: stock runs 1 forwards before stage 1's first backward",
            bodies={
                'one_f_one_b': """\
# TODO (one_f_one_b): the list of ("F", i) and ("B", i) actions of stage stage_index: a
# warm-up of forwards, then one backward and one forward in turn, then the backwards left.
warmup = min(n, num_stages - stage_index)
actions = [("F", i) for i in range(warmup)]
f, b = warmup, 0
while f < n:
    actions.append(("F", f)); f += 1
    actions.append(("B", b)); b += 1
actions += [("B", i) for i in range(b, n)]
return actions
""",
            }),
        'wrong_warmup_minus1': dict(
            mistake='warm-up p-r-1 but steady B then F (off by one)',
            ranks=2, alone=False, verdict='named',
            said="the warm-up: stock runs 2 forwards before stage 0's first backward",
            bodies={
                'one_f_one_b': """\
# TODO (one_f_one_b): the list of ("F", i) and ("B", i) actions of stage stage_index: a
# warm-up of forwards, then one backward and one forward in turn, then the backwards left.
warmup = min(n, num_stages - stage_index - 1)
actions = [("F", i) for i in range(warmup)]
f, b = warmup, 0
while f < n:
    actions.append(("B", b)); b += 1
    actions.append(("F", f)); f += 1
actions += [("B", i) for i in range(b, n)]
return actions
""",
            }),
        'wrong_warmup_reversed': dict(
            mistake='warm-up stage_index+1 (counted from the wrong end)',
            ranks=2, alone=False, verdict='named',
            said="the warm-up: stock runs 2 forwards before stage 0's first backward",
            bodies={
                'one_f_one_b': """\
# TODO (one_f_one_b): the list of ("F", i) and ("B", i) actions of stage stage_index: a
# warm-up of forwards, then one backward and one forward in turn, then the backwards left.
warmup = min(n, stage_index + 1)
actions = [("F", i) for i in range(warmup)]
f, b = warmup, 0
while f < n:
    actions.append(("B", b)); b += 1
    actions.append(("F", f)); f += 1
actions += [("B", i) for i in range(b, n)]
return actions
""",
            }),
    },
    'recompute': {
        'wrong_no_autocast': dict(
            mistake='autocast state of the forward not replayed',
            ranks=1, alone=False, verdict='named',
            said='under autocast only: the second forward did not run under the first',
            bodies={
                'checkpoint': '# TODO (checkpoint): run function(*args, **kwargs) under saved-tensor hooks\n# (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor an\n# op saves by its number; the first unpack of a backward runs the function again on the\n# arguments cut from the graph (_cut), with the random state saved before the forward put\n# back (unless preserve_rng_state=False) and the autocast state of the forward, inside\n# torch.random.fork_rng so that the RNG after is as before (only when preserve_rng_state:\n# without it, stock leaves the RNG where the run\'s draws left it); it collects the tensors\n# that run saves, in order (raise _Stop after the last), and answers each number with its\n# tensor, once. Refuse an argument changed in place since the forward (its _version).\n# Selective (save_ops): the forward under Keep(kept, save_ops), the second under\n# Reuse(kept, save_ops).\nversions = [a._version if torch.is_tensor(a) else None for a in args]\ncpu_rng = torch.get_rng_state() if preserve_rng_state else None\nautocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),\n            torch.is_autocast_cache_enabled())\nkept = []  # selective: the saved ops\' outputs\ncount = [0]\nanswers = {}\n\ndef pack(tensor):\n    number = count[0]\n    count[0] += 1\n    return number\n\ndef recompute():\n    for a, v in zip(args, versions):\n        if torch.is_tensor(a) and a._version != v:\n            raise RuntimeError("checkpoint: an argument was modified in place since the"\n                               " forward")\n    cut = [_cut(a) for a in args]\n    got = []\n\n    def pack_again(tensor):\n        got.append(tensor.detach() if tensor.requires_grad else tensor)\n        if len(got) == count[0]:\n            raise _Stop\n        return None\n\n    with torch.random.fork_rng(devices=[], enabled=preserve_rng_state):\n        if preserve_rng_state:\n            torch.set_rng_state(cpu_rng)\n        mode = Reuse(kept, save_ops) if save_ops else contextlib.nullcontext()\n        with torch.enable_grad(), contextlib.nullcontext(), \\\n                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda x: x), mode:\n            try:\n                function(*cut, **kwargs)\n            except _Stop:\n                pass\n    answers.update(enumerate(got))\n\ndef unpack(number):\n    if number not in answers:\n        recompute()\n    return answers.pop(number)\n\nmode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:\n    return function(*args, **kwargs)\n',
            }),
        'wrong_no_fork': dict(
            mistake='no fork_rng: RNG left where the recompute put it',
            ranks=1, alone=False, verdict='named',
            said="every gradient is stock's, but not the random state after backward:",
            bodies={
                'checkpoint': '# TODO (checkpoint): run function(*args, **kwargs) under saved-tensor hooks\n# (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor an\n# op saves by its number; the first unpack of a backward runs the function again on the\n# arguments cut from the graph (_cut), with the random state saved before the forward put\n# back (unless preserve_rng_state=False) and the autocast state of the forward, inside\n# torch.random.fork_rng so that the RNG after is as before (only when preserve_rng_state:\n# without it, stock leaves the RNG where the run\'s draws left it); it collects the tensors\n# that run saves, in order (raise _Stop after the last), and answers each number with its\n# tensor, once. Refuse an argument changed in place since the forward (its _version).\n# Selective (save_ops): the forward under Keep(kept, save_ops), the second under\n# Reuse(kept, save_ops).\nversions = [a._version if torch.is_tensor(a) else None for a in args]\ncpu_rng = torch.get_rng_state() if preserve_rng_state else None\nautocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),\n            torch.is_autocast_cache_enabled())\nkept = []  # selective: the saved ops\' outputs\ncount = [0]\nanswers = {}\n\ndef pack(tensor):\n    number = count[0]\n    count[0] += 1\n    return number\n\ndef recompute():\n    for a, v in zip(args, versions):\n        if torch.is_tensor(a) and a._version != v:\n            raise RuntimeError("checkpoint: an argument was modified in place since the"\n                               " forward")\n    cut = [_cut(a) for a in args]\n    got = []\n\n    def pack_again(tensor):\n        got.append(tensor.detach() if tensor.requires_grad else tensor)\n        if len(got) == count[0]:\n            raise _Stop\n        return None\n\n    with contextlib.nullcontext():\n        if preserve_rng_state:\n            torch.set_rng_state(cpu_rng)\n        mode = Reuse(kept, save_ops) if save_ops else contextlib.nullcontext()\n        with torch.enable_grad(), torch.autocast("cpu", enabled=autocast[0], dtype=autocast[1],\n                                                 cache_enabled=autocast[2]), \\\n                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda x: x), mode:\n            try:\n                function(*cut, **kwargs)\n            except _Stop:\n                pass\n    answers.update(enumerate(got))\n\ndef unpack(number):\n    if number not in answers:\n        recompute()\n    return answers.pop(number)\n\nmode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:\n    return function(*args, **kwargs)\n',
            }),
        'wrong_no_reuse': dict(
            mistake="selective's second forward not under Reuse (matmuls recomputed)",
            ranks=1, alone=False, verdict='named',
            said="selective keeps less than stock's (0 bytes, stock's 960): the outputs",
            bodies={
                'checkpoint': '# TODO (checkpoint): run function(*args, **kwargs) under saved-tensor hooks\n# (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor an\n# op saves by its number; the first unpack of a backward runs the function again on the\n# arguments cut from the graph (_cut), with the random state saved before the forward put\n# back (unless preserve_rng_state=False) and the autocast state of the forward, inside\n# torch.random.fork_rng so that the RNG after is as before (only when preserve_rng_state:\n# without it, stock leaves the RNG where the run\'s draws left it); it collects the tensors\n# that run saves, in order (raise _Stop after the last), and answers each number with its\n# tensor, once. Refuse an argument changed in place since the forward (its _version).\n# Selective (save_ops): the forward under Keep(kept, save_ops), the second under\n# Reuse(kept, save_ops).\nversions = [a._version if torch.is_tensor(a) else None for a in args]\ncpu_rng = torch.get_rng_state() if preserve_rng_state else None\nautocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),\n            torch.is_autocast_cache_enabled())\nkept = []  # selective: the saved ops\' outputs\ncount = [0]\nanswers = {}\n\ndef pack(tensor):\n    number = count[0]\n    count[0] += 1\n    return number\n\ndef recompute():\n    for a, v in zip(args, versions):\n        if torch.is_tensor(a) and a._version != v:\n            raise RuntimeError("checkpoint: an argument was modified in place since the"\n                               " forward")\n    cut = [_cut(a) for a in args]\n    got = []\n\n    def pack_again(tensor):\n        got.append(tensor.detach() if tensor.requires_grad else tensor)\n        if len(got) == count[0]:\n            raise _Stop\n        return None\n\n    with torch.random.fork_rng(devices=[], enabled=preserve_rng_state):\n        if preserve_rng_state:\n            torch.set_rng_state(cpu_rng)\n        mode = contextlib.nullcontext()\n        with torch.enable_grad(), torch.autocast("cpu", enabled=autocast[0], dtype=autocast[1],\n                                                 cache_enabled=autocast[2]), \\\n                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda x: x), mode:\n            try:\n                function(*cut, **kwargs)\n            except _Stop:\n                pass\n    answers.update(enumerate(got))\n\ndef unpack(number):\n    if number not in answers:\n        recompute()\n    return answers.pop(number)\n\nmode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:\n    return function(*args, **kwargs)\n',
            }),
        'wrong_no_version_check': dict(
            mistake='no refusal of an argument changed in place (TODO asks for it; stock raises)',
            ranks=1, alone=False, verdict='named',
            said='the argument changed in place, and yours ran the second forward',
            bodies={
                'checkpoint': '# TODO (checkpoint): run function(*args, **kwargs) under saved-tensor hooks\n# (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor an\n# op saves by its number; the first unpack of a backward runs the function again on the\n# arguments cut from the graph (_cut), with the random state saved before the forward put\n# back (unless preserve_rng_state=False) and the autocast state of the forward, inside\n# torch.random.fork_rng so that the RNG after is as before (only when preserve_rng_state:\n# without it, stock leaves the RNG where the run\'s draws left it); it collects the tensors\n# that run saves, in order (raise _Stop after the last), and answers each number with its\n# tensor, once. Refuse an argument changed in place since the forward (its _version).\n# Selective (save_ops): the forward under Keep(kept, save_ops), the second under\n# Reuse(kept, save_ops).\nversions = [a._version if torch.is_tensor(a) else None for a in args]\ncpu_rng = torch.get_rng_state() if preserve_rng_state else None\nautocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),\n            torch.is_autocast_cache_enabled())\nkept = []  # selective: the saved ops\' outputs\ncount = [0]\nanswers = {}\n\ndef pack(tensor):\n    number = count[0]\n    count[0] += 1\n    return number\n\ndef recompute():\n    cut = [_cut(a) for a in args]\n    got = []\n\n    def pack_again(tensor):\n        got.append(tensor.detach() if tensor.requires_grad else tensor)\n        if len(got) == count[0]:\n            raise _Stop\n        return None\n\n    with torch.random.fork_rng(devices=[], enabled=preserve_rng_state):\n        if preserve_rng_state:\n            torch.set_rng_state(cpu_rng)\n        mode = Reuse(kept, save_ops) if save_ops else contextlib.nullcontext()\n        with torch.enable_grad(), torch.autocast("cpu", enabled=autocast[0], dtype=autocast[1],\n                                                 cache_enabled=autocast[2]), \\\n                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda x: x), mode:\n            try:\n                function(*cut, **kwargs)\n            except _Stop:\n                pass\n    answers.update(enumerate(got))\n\ndef unpack(number):\n    if number not in answers:\n        recompute()\n    return answers.pop(number)\n\nmode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:\n    return function(*args, **kwargs)\n',
            }),
        'wrong_rng_not_restored': dict(
            mistake='RNG state not put back before the second forward',
            ranks=1, alone=False, verdict='named',
            said='only where dropout draws: the second forward drew other masks than',
            bodies={
                'checkpoint': '# TODO (checkpoint): run function(*args, **kwargs) under saved-tensor hooks\n# (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor an\n# op saves by its number; the first unpack of a backward runs the function again on the\n# arguments cut from the graph (_cut), with the random state saved before the forward put\n# back (unless preserve_rng_state=False) and the autocast state of the forward, inside\n# torch.random.fork_rng so that the RNG after is as before (only when preserve_rng_state:\n# without it, stock leaves the RNG where the run\'s draws left it); it collects the tensors\n# that run saves, in order (raise _Stop after the last), and answers each number with its\n# tensor, once. Refuse an argument changed in place since the forward (its _version).\n# Selective (save_ops): the forward under Keep(kept, save_ops), the second under\n# Reuse(kept, save_ops).\nversions = [a._version if torch.is_tensor(a) else None for a in args]\ncpu_rng = torch.get_rng_state() if preserve_rng_state else None\nautocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),\n            torch.is_autocast_cache_enabled())\nkept = []  # selective: the saved ops\' outputs\ncount = [0]\nanswers = {}\n\ndef pack(tensor):\n    number = count[0]\n    count[0] += 1\n    return number\n\ndef recompute():\n    for a, v in zip(args, versions):\n        if torch.is_tensor(a) and a._version != v:\n            raise RuntimeError("checkpoint: an argument was modified in place since the"\n                               " forward")\n    cut = [_cut(a) for a in args]\n    got = []\n\n    def pack_again(tensor):\n        got.append(tensor.detach() if tensor.requires_grad else tensor)\n        if len(got) == count[0]:\n            raise _Stop\n        return None\n\n    with torch.random.fork_rng(devices=[], enabled=preserve_rng_state):\n        mode = Reuse(kept, save_ops) if save_ops else contextlib.nullcontext()\n        with torch.enable_grad(), torch.autocast("cpu", enabled=autocast[0], dtype=autocast[1],\n                                                 cache_enabled=autocast[2]), \\\n                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda x: x), mode:\n            try:\n                function(*cut, **kwargs)\n            except _Stop:\n                pass\n    answers.update(enumerate(got))\n\ndef unpack(number):\n    if number not in answers:\n        recompute()\n    return answers.pop(number)\n\nmode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:\n    return function(*args, **kwargs)\n',
            }),
        'wrong_rng_saved_after': dict(
            mistake='RNG state captured after the forward, not before',
            ranks=1, alone=False, verdict='named',
            said='only where dropout draws: the second forward drew other masks than',
            bodies={
                'checkpoint': '# TODO (checkpoint): run function(*args, **kwargs) under saved-tensor hooks\n# (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor an\n# op saves by its number; the first unpack of a backward runs the function again on the\n# arguments cut from the graph (_cut), with the random state saved before the forward put\n# back (unless preserve_rng_state=False) and the autocast state of the forward, inside\n# torch.random.fork_rng so that the RNG after is as before (only when preserve_rng_state:\n# without it, stock leaves the RNG where the run\'s draws left it); it collects the tensors\n# that run saves, in order (raise _Stop after the last), and answers each number with its\n# tensor, once. Refuse an argument changed in place since the forward (its _version).\n# Selective (save_ops): the forward under Keep(kept, save_ops), the second under\n# Reuse(kept, save_ops).\nversions = [a._version if torch.is_tensor(a) else None for a in args]\ncpu_rng = None\nautocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),\n            torch.is_autocast_cache_enabled())\nkept = []  # selective: the saved ops\' outputs\ncount = [0]\nanswers = {}\n\ndef pack(tensor):\n    number = count[0]\n    count[0] += 1\n    return number\n\ndef recompute():\n    for a, v in zip(args, versions):\n        if torch.is_tensor(a) and a._version != v:\n            raise RuntimeError("checkpoint: an argument was modified in place since the"\n                               " forward")\n    cut = [_cut(a) for a in args]\n    got = []\n\n    def pack_again(tensor):\n        got.append(tensor.detach() if tensor.requires_grad else tensor)\n        if len(got) == count[0]:\n            raise _Stop\n        return None\n\n    with torch.random.fork_rng(devices=[], enabled=preserve_rng_state):\n        if preserve_rng_state:\n            torch.set_rng_state(cpu_rng)\n        mode = Reuse(kept, save_ops) if save_ops else contextlib.nullcontext()\n        with torch.enable_grad(), torch.autocast("cpu", enabled=autocast[0], dtype=autocast[1],\n                                                 cache_enabled=autocast[2]), \\\n                torch.autograd.graph.saved_tensors_hooks(pack_again, lambda x: x), mode:\n            try:\n                function(*cut, **kwargs)\n            except _Stop:\n                pass\n    answers.update(enumerate(got))\n\ndef unpack(number):\n    if number not in answers:\n        recompute()\n    return answers.pop(number)\n\nmode = Keep(kept, save_ops) if save_ops else contextlib.nullcontext()\nwith torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:\n    result = function(*args, **kwargs)\ncpu_rng = torch.get_rng_state()\nreturn result\n',
            }),
    },
    'ring': {
        'w_recv_empty_block': dict(
            mistake='receives into the whole buffer, also for an empty block (nothing is sent)',
            ranks=2, alone=False, verdict='named',
            said='a receive and a send that do not pair up',
            bodies={
                'ring_reduce_scatter': """\
rank, size = rank_and_size(group)
to, came_from = (rank - 1) % size, (rank + 1) % size
incoming = torch.empty(max(b.numel() for b in blocks), dtype=blocks[0].dtype)
for step in range(size - 1):
    mine = blocks[(rank + step + 2) % size]
    exchange(group, sends=[(blocks[(rank + step + 1) % size], to)],
             receives=[(incoming, came_from)])
    combine(op, mine, incoming[:mine.numel()])
""",
            }),
        'wrong_new_tensors': dict(
            mistake='each sum written into a new tensor (blocks[i] = ...): the caller never sees it',
            ranks=2, alone=False, verdict='named',
            said="gave blocks[0] a new tensor (blocks[i] = ...): the caller's blocks are views of its own buffer, and those were never written",
            bodies={
                'ring_reduce_scatter': """\
rank, size = rank_and_size(group)
for step in range(size - 1):
    send = (rank + step + 1) % size
    recv = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv])
    exchange(group, sends=[(blocks[send], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    blocks[recv] = blocks[recv] + arrived
""",
            }),
        'wrong_own_block_first': dict(
            mistake='step 0 sends its own block rank (not rank + 1), each step a block early',
            ranks=2, alone=False, verdict='named',
            said="block 0's whole SUM ends on rank 1, not on rank 0: each step works a block early",
            bodies={
                'ring_reduce_scatter': """\
rank, size = rank_and_size(group)
for step in range(size - 1):
    send = (rank + step) % size  # my own block first
    recv = (rank + step + 1) % size
    arrived = torch.empty_like(blocks[recv])
    exchange(group, sends=[(blocks[send], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    combine(op, blocks[recv], arrived)
""",
            }),
        'wrong_blocking_sends': dict(
            mistake='a blocking send, then a blocking receive, on every rank (a deadlock)',
            ranks=2, alone=False, verdict='named',
            said='a deadlock: every rank waits in a blocking send for a receive its peer posts only after its own send returns',
            bodies={
                'ring_reduce_scatter': """\
import torch.distributed as dist
rank, size = rank_and_size(group)
for step in range(size - 1):
    out, into = blocks[(rank + step + 1) % size], blocks[(rank + step + 2) % size]
    arrived = torch.empty_like(into)
    if out.numel():
        dist.send(out, (rank - 1) % size)
    if into.numel():
        dist.recv(arrived, (rank + 1) % size)
    combine(op, into, arrived)
""",
            }),
        'wrong_sums_off_by_2^-16': dict(
            mistake='the ring the other way, each partial sum 2^-16 too large',
            ranks=4, alone=False, verdict='named',
            said='as far from it as any order of adding W = 4 values may land',
            bodies={
                'ring_reduce_scatter': """\
rank, size = rank_and_size(group)
for step in range(size - 1):
    out = blocks[(rank - step - 1) % size]
    into = blocks[(rank - step - 2) % size]
    arrived = torch.empty_like(into)
    exchange(group, sends=[(out, (rank + 1) % size)], receives=[(arrived, (rank - 1) % size)])
    combine(op, into, arrived * (1 + 2 ** -16))
""",
            }),
        'wrong_direction': dict(
            mistake='sends to rank+1 / receives from rank-1 (other direction)',
            ranks=3, alone=False, verdict='named',
            said='a receive and a send that do not pair up',
            bodies={
                'ring_reduce_scatter': """\
# TODO (ring_reduce_scatter): W - 1 steps round the ring: send to rank - 1 the block whose
# partial sum you made in the step before (at step 0, your own block rank + 1), receive
# from rank + 1 the next one (block rank + step + 2) and combine it into your own copy of
# that block, mine <- op(mine, arrived); both at once (p2p.exchange), so that rank b ends
# with block b reduced, x_b + (x_{b+1} + (... + x_{b-1})).
rank, size = rank_and_size(group)
send_block = (rank + 1) % size
for step in range(size - 1):
    recv_block = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv_block])
    exchange(group, sends=[(blocks[send_block], (rank + 1) % size)],
             receives=[(arrived, (rank - 1) % size)])
    combine(op, blocks[recv_block], arrived)
    send_block = recv_block
""",
            }),
        'wrong_first_block': dict(
            mistake='step 0 sends own block `rank` instead of rank+1',
            ranks=2, alone=False, verdict='named',
            said='a receive and a send that do not pair up',
            bodies={
                'ring_reduce_scatter': """\
# TODO (ring_reduce_scatter): W - 1 steps round the ring: send to rank - 1 the block whose
# partial sum you made in the step before (at step 0, your own block rank + 1), receive
# from rank + 1 the next one (block rank + step + 2) and combine it into your own copy of
# that block, mine <- op(mine, arrived); both at once (p2p.exchange), so that rank b ends
# with block b reduced, x_b + (x_{b+1} + (... + x_{b-1})).
rank, size = rank_and_size(group)
send_block = rank
for step in range(size - 1):
    recv_block = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv_block])
    exchange(group, sends=[(blocks[send_block], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    combine(op, blocks[recv_block], arrived)
    send_block = recv_block
""",
            }),
        'wrong_no_combine': dict(
            mistake='arrived copied over mine, not combined',
            ranks=2, alone=False, verdict='named',
            said="block 0 holds rank 1's value alone: each step copied what arrived",
            bodies={
                'ring_reduce_scatter': """\
# TODO (ring_reduce_scatter): W - 1 steps round the ring: send to rank - 1 the block whose
# partial sum you made in the step before (at step 0, your own block rank + 1), receive
# from rank + 1 the next one (block rank + step + 2) and combine it into your own copy of
# that block, mine <- op(mine, arrived); both at once (p2p.exchange), so that rank b ends
# with block b reduced, x_b + (x_{b+1} + (... + x_{b-1})).
rank, size = rank_and_size(group)
send_block = (rank + 1) % size
for step in range(size - 1):
    recv_block = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv_block])
    exchange(group, sends=[(blocks[send_block], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    blocks[recv_block].copy_(arrived)
    send_block = recv_block
""",
            }),
        'wrong_recv_index': dict(
            mistake='receives block rank+step+1 (off by one)',
            ranks=2, alone=False, verdict='named',
            said='a receive and a send that do not pair up',
            bodies={
                'ring_reduce_scatter': """\
# TODO (ring_reduce_scatter): W - 1 steps round the ring: send to rank - 1 the block whose
# partial sum you made in the step before (at step 0, your own block rank + 1), receive
# from rank + 1 the next one (block rank + step + 2) and combine it into your own copy of
# that block, mine <- op(mine, arrived); both at once (p2p.exchange), so that rank b ends
# with block b reduced, x_b + (x_{b+1} + (... + x_{b-1})).
rank, size = rank_and_size(group)
send_block = (rank + 1) % size
for step in range(size - 1):
    recv_block = (rank + step + 1) % size
    arrived = torch.empty_like(blocks[recv_block])
    exchange(group, sends=[(blocks[send_block], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    combine(op, blocks[recv_block], arrived)
    send_block = recv_block
""",
            }),
        'wrong_send_raw': dict(
            mistake='forwards its original (un-reduced) block, not the partial sum',
            ranks=3, alone=False, verdict='named',
            said="the SUM of W - 1 = 2 ranks' values: rank 2's is missing: a step",
            bodies={
                'ring_reduce_scatter': """\
# TODO (ring_reduce_scatter): W - 1 steps round the ring: send to rank - 1 the block whose
# partial sum you made in the step before (at step 0, your own block rank + 1), receive
# from rank + 1 the next one (block rank + step + 2) and combine it into your own copy of
# that block, mine <- op(mine, arrived); both at once (p2p.exchange), so that rank b ends
# with block b reduced, x_b + (x_{b+1} + (... + x_{b-1})).
rank, size = rank_and_size(group)
send_block = (rank + 1) % size
original = [b.clone() for b in blocks]
for step in range(size - 1):
    recv_block = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv_block])
    outgoing = blocks[send_block].clone() if step == 0 else original[send_block]
    exchange(group, sends=[(outgoing, (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    combine(op, blocks[recv_block], arrived)
    send_block = recv_block
""",
            }),
        'wrong_steps': dict(
            mistake='W steps instead of W-1 (one extra send/recv round)',
            ranks=2, alone=False, verdict='named',
            said='a step more sends a block already reduced round again',
            bodies={
                'ring_reduce_scatter': """\
# TODO (ring_reduce_scatter): W - 1 steps round the ring: send to rank - 1 the block whose
# partial sum you made in the step before (at step 0, your own block rank + 1), receive
# from rank + 1 the next one (block rank + step + 2) and combine it into your own copy of
# that block, mine <- op(mine, arrived); both at once (p2p.exchange), so that rank b ends
# with block b reduced, x_b + (x_{b+1} + (... + x_{b-1})).
rank, size = rank_and_size(group)
send_block = (rank + 1) % size
for step in range(size):
    recv_block = (rank + step + 2) % size
    arrived = torch.empty_like(blocks[recv_block])
    exchange(group, sends=[(blocks[send_block], (rank - 1) % size)],
             receives=[(arrived, (rank + 1) % size)])
    combine(op, blocks[recv_block], arrived)
    send_block = recv_block
""",
            }),
    },
    'ring_attention': {
        'wrong_diag_unmasked': dict(
            mistake='diagonal block causal=False',
            ranks=2, alone=False, verdict='named',
            said='computes pairs the causal mask excludes (6 of them): the query at',
            bodies={
                'chunk_ids': """\
# TODO (chunk_ids): the chunks of the sequence this rank holds, in order: in order, chunk
# rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the end,
# 2 * world_size - 1 - rank (stock's head-tail load balancer).
if zigzag:
    return [rank, 2 * world_size - 1 - rank]
return [rank]
""",
                'part_of_block': """\
# TODO (part_of_block): what rank `rank`'s queries compute against the keys of rank
# `source`: (rows, cols, causal) slices of this rank's `length` positions, or None for
# nothing: the rows that see any of its keys, the keys those rows see, causal=True only
# where that block is not whole (the diagonal block s = r). No mask: everything. In order:
# an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late chunk
# each): an earlier rank's early chunk for all my rows; a later rank's keys, whole, for my
# late chunk only.
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if source == rank:
    return everything, everything, False
half = length // 2
if zigzag:
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, length), everything, False
return (everything, everything, False) if source < rank else None
""",
                'ring_forward': """\
# TODO (ring_forward): size steps round the ring: before computing, pass the k and v block
# held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next
# rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it with the
# kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing dimension
# of 1); the first step starts (out, lse), each later one merges into the rows it covers
# (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the next block. Return
# out in q's dtype and lse without the trailing dimension, in torch.promote_types(q.dtype,
# torch.float32).
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    if step + 1 < size:
        incoming = pass_on(kv, group, KV)
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                      causal, scale)
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)
    if step + 1 < size:
        kv = incoming.wait()
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
            }),
        'wrong_inorder_later_whole': dict(
            mistake="in order, later ranks' keys whole, earlier none (comparison reversed)",
            ranks=2, alone=False, verdict='named',
            said='computes pairs the causal mask excludes (16 of them): the query at',
            bodies={
                'chunk_ids': """\
# TODO (chunk_ids): the chunks of the sequence this rank holds, in order: in order, chunk
# rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the end,
# 2 * world_size - 1 - rank (stock's head-tail load balancer).
if zigzag:
    return [rank, 2 * world_size - 1 - rank]
return [rank]
""",
                'part_of_block': """\
# TODO (part_of_block): what rank `rank`'s queries compute against the keys of rank
# `source`: (rows, cols, causal) slices of this rank's `length` positions, or None for
# nothing: the rows that see any of its keys, the keys those rows see, causal=True only
# where that block is not whole (the diagonal block s = r). No mask: everything. In order:
# an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late chunk
# each): an earlier rank's early chunk for all my rows; a later rank's keys, whole, for my
# late chunk only.
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if source == rank:
    return everything, everything, True
half = length // 2
if zigzag:
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, length), everything, False
return (everything, everything, False) if source > rank else None
""",
                'ring_forward': """\
# TODO (ring_forward): size steps round the ring: before computing, pass the k and v block
# held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next
# rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it with the
# kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing dimension
# of 1); the first step starts (out, lse), each later one merges into the rows it covers
# (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the next block. Return
# out in q's dtype and lse without the trailing dimension, in torch.promote_types(q.dtype,
# torch.float32).
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    if step + 1 < size:
        incoming = pass_on(kv, group, KV)
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                      causal, scale)
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)
    if step + 1 < size:
        kv = incoming.wait()
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
            }),
        'wrong_mirror_offbyone': dict(
            mistake='zig-zag mirror 2W-rank-2',
            ranks=2, alone=False, verdict='named',
            said="rank 0 of 1: yours [0, 0], stock's [0, 1]: zig-zag cuts the sequence",
            bodies={
                'chunk_ids': """\
# TODO (chunk_ids): the chunks of the sequence this rank holds, in order: in order, chunk
# rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the end,
# 2 * world_size - 1 - rank (stock's head-tail load balancer).
if zigzag:
    return [rank, 2 * world_size - rank - 2]
return [rank]
""",
                'part_of_block': """\
# TODO (part_of_block): what rank `rank`'s queries compute against the keys of rank
# `source`: (rows, cols, causal) slices of this rank's `length` positions, or None for
# nothing: the rows that see any of its keys, the keys those rows see, causal=True only
# where that block is not whole (the diagonal block s = r). No mask: everything. In order:
# an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late chunk
# each): an earlier rank's early chunk for all my rows; a later rank's keys, whole, for my
# late chunk only.
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if source == rank:
    return everything, everything, True
half = length // 2
if zigzag:
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, length), everything, False
return (everything, everything, False) if source < rank else None
""",
                'ring_forward': """\
# TODO (ring_forward): size steps round the ring: before computing, pass the k and v block
# held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next
# rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it with the
# kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing dimension
# of 1); the first step starts (out, lse), each later one merges into the rows it covers
# (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the next block. Return
# out in q's dtype and lse without the trailing dimension, in torch.promote_types(q.dtype,
# torch.float32).
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    if step + 1 < size:
        incoming = pass_on(kv, group, KV)
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                      causal, scale)
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)
    if step + 1 < size:
        kv = incoming.wait()
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
            }),
        'wrong_source_direction': dict(
            mistake='step i computes part_of_block for source (rank+i)%W (ring direction reversed)',
            ranks=4, alone=False, verdict='caught',
            said="not the attention of the whole sequence, nor a usual mistake's merge:",
            bodies={
                'chunk_ids': """\
# TODO (chunk_ids): the chunks of the sequence this rank holds, in order: in order, chunk
# rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the end,
# 2 * world_size - 1 - rank (stock's head-tail load balancer).
if zigzag:
    return [rank, 2 * world_size - 1 - rank]
return [rank]
""",
                'part_of_block': """\
# TODO (part_of_block): what rank `rank`'s queries compute against the keys of rank
# `source`: (rows, cols, causal) slices of this rank's `length` positions, or None for
# nothing: the rows that see any of its keys, the keys those rows see, causal=True only
# where that block is not whole (the diagonal block s = r). No mask: everything. In order:
# an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late chunk
# each): an earlier rank's early chunk for all my rows; a later rank's keys, whole, for my
# late chunk only.
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if source == rank:
    return everything, everything, True
half = length // 2
if zigzag:
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, length), everything, False
return (everything, everything, False) if source < rank else None
""",
                'ring_forward': """\
# TODO (ring_forward): size steps round the ring: before computing, pass the k and v block
# held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next
# rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it with the
# kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing dimension
# of 1); the first step starts (out, lse), each later one merges into the rows it covers
# (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the next block. Return
# out in q's dtype and lse without the trailing dimension, in torch.promote_types(q.dtype,
# torch.float32).
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    if step + 1 < size:
        incoming = pass_on(kv, group, KV)
    part = part_of_block(rank, (rank + step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                      causal, scale)
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)
    if step + 1 < size:
        kv = incoming.wait()
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
            }),
        'wrong_zigzag_early_rows': dict(
            mistake="later rank's keys given to my early rows",
            ranks=2, alone=False, verdict='named',
            said='computes pairs the causal mask excludes (8 of them): the query at',
            bodies={
                'chunk_ids': """\
# TODO (chunk_ids): the chunks of the sequence this rank holds, in order: in order, chunk
# rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the end,
# 2 * world_size - 1 - rank (stock's head-tail load balancer).
if zigzag:
    return [rank, 2 * world_size - 1 - rank]
return [rank]
""",
                'part_of_block': """\
# TODO (part_of_block): what rank `rank`'s queries compute against the keys of rank
# `source`: (rows, cols, causal) slices of this rank's `length` positions, or None for
# nothing: the rows that see any of its keys, the keys those rows see, causal=True only
# where that block is not whole (the diagonal block s = r). No mask: everything. In order:
# an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late chunk
# each): an earlier rank's early chunk for all my rows; a later rank's keys, whole, for my
# late chunk only.
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if source == rank:
    return everything, everything, True
half = length // 2
if zigzag:
    if source < rank:
        return everything, slice(0, half), False
    return slice(0, half), everything, False
return (everything, everything, False) if source < rank else None
""",
                'ring_forward': """\
# TODO (ring_forward): size steps round the ring: before computing, pass the k and v block
# held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next
# rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it with the
# kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing dimension
# of 1); the first step starts (out, lse), each later one merges into the rows it covers
# (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the next block. Return
# out in q's dtype and lse without the trailing dimension, in torch.promote_types(q.dtype,
# torch.float32).
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    if step + 1 < size:
        incoming = pass_on(kv, group, KV)
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                      causal, scale)
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)
    if step + 1 < size:
        kv = incoming.wait()
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
            }),
        'wrong_zigzag_late_cols': dict(
            mistake="earlier rank's LATE chunk used as cols",
            ranks=2, alone=False, verdict='named',
            said='computes pairs the causal mask excludes (8 of them): the query at',
            bodies={
                'chunk_ids': """\
# TODO (chunk_ids): the chunks of the sequence this rank holds, in order: in order, chunk
# rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the end,
# 2 * world_size - 1 - rank (stock's head-tail load balancer).
if zigzag:
    return [rank, 2 * world_size - 1 - rank]
return [rank]
""",
                'part_of_block': """\
# TODO (part_of_block): what rank `rank`'s queries compute against the keys of rank
# `source`: (rows, cols, causal) slices of this rank's `length` positions, or None for
# nothing: the rows that see any of its keys, the keys those rows see, causal=True only
# where that block is not whole (the diagonal block s = r). No mask: everything. In order:
# an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late chunk
# each): an earlier rank's early chunk for all my rows; a later rank's keys, whole, for my
# late chunk only.
everything = slice(0, length)
if not is_causal:
    return everything, everything, False
if source == rank:
    return everything, everything, True
half = length // 2
if zigzag:
    if source < rank:
        return everything, slice(half, length), False
    return slice(half, length), everything, False
return (everything, everything, False) if source < rank else None
""",
                'ring_forward': """\
# TODO (ring_forward): size steps round the ring: before computing, pass the k and v block
# held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next
# rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it with the
# kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing dimension
# of 1); the first step starts (out, lse), each later one merges into the rows it covers
# (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the next block. Return
# out in q's dtype and lse without the trailing dimension, in torch.promote_types(q.dtype,
# torch.float32).
rank, size = dist.get_rank(group), dist.get_world_size(group)
attend = KERNELS[kernel][0]
kv = torch.cat([k.flatten(), v.flatten()])
out = lse = None
for step in range(size):
    if step + 1 < size:
        incoming = pass_on(kv, group, KV)
    part = part_of_block(rank, (rank - step) % size, is_causal, zigzag, q.shape[2])
    if part is not None:
        rows, cols, causal = part
        key, value = _split(kv, k)
        block_out, block_lse = attend(q[:, :, rows], key[:, :, cols], value[:, :, cols],
                                      causal, scale)
        block_out, block_lse = block_out.float(), block_lse.float().unsqueeze(-1)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     block_out, block_lse)
    if step + 1 < size:
        kv = incoming.wait()
return out.to(q.dtype), lse.squeeze(-1).to(torch.promote_types(q.dtype, torch.float32))
""",
            }),
    },
    'sampler': {
        'w_contiguous': dict(
            mistake='a contiguous block per rank instead of strided deal',
            ranks=2, alone=False, verdict='named',
            said='the same indices, dealt to other ranks: stock deals positions rank,',
            bodies={
                'ShardSampler.__iter__': """\
if self.shuffle:
    g = torch.Generator()
    g.manual_seed(self.seed + self.epoch)
    indices = torch.randperm(len(self.dataset), generator=g).tolist()
else:
    indices = list(range(len(self.dataset)))
if not self.drop_last:
    pad = self.total_size - len(indices)
    while pad > 0:
        take = indices[:pad]
        indices += take
        pad -= len(take)
else:
    indices = indices[:self.total_size]
assert len(indices) == self.total_size
return iter(indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples])
""",
            }),
        'w_droplast_nocut': dict(
            mistake='drop_last does not cut the tail',
            ranks=2, alone=False, verdict='named',
            said="rank 0 gets 1 indices, stock's 0: every rank must get as many (pad by",
            bodies={
                'ShardSampler.__iter__': """\
if self.shuffle:
    g = torch.Generator()
    g.manual_seed(self.seed + self.epoch)
    indices = torch.randperm(len(self.dataset), generator=g).tolist()
else:
    indices = list(range(len(self.dataset)))
if not self.drop_last:
    pad = self.total_size - len(indices)
    while pad > 0:
        take = indices[:pad]
        indices += take
        pad -= len(take)
else:
    pass
return iter(indices[self.rank::self.num_replicas])
""",
            }),
        'w_ignore_shuffle': dict(
            mistake='always shuffles, ignores shuffle=False',
            ranks=1, alone=False, verdict='named',
            said="each rank gets stock's indices, in another order: shuffle=False keeps",
            bodies={
                'ShardSampler.__iter__': """\
if True:
    g = torch.Generator()
    g.manual_seed(self.seed + self.epoch)
    indices = torch.randperm(len(self.dataset), generator=g).tolist()
else:
    indices = list(range(len(self.dataset)))
if not self.drop_last:
    pad = self.total_size - len(indices)
    while pad > 0:
        take = indices[:pad]
        indices += take
        pad -= len(take)
else:
    indices = indices[:self.total_size]
assert len(indices) == self.total_size
return iter(indices[self.rank:self.total_size:self.num_replicas])
""",
            }),
        'w_noepoch': dict(
            mistake='generator seeded with seed only (epoch ignored)',
            ranks=1, alone=False, verdict='named',
            said='the same order every epoch: seed the generator with seed + epoch',
            bodies={
                'ShardSampler.__iter__': """\
if self.shuffle:
    g = torch.Generator()
    g.manual_seed(self.seed)
    indices = torch.randperm(len(self.dataset), generator=g).tolist()
else:
    indices = list(range(len(self.dataset)))
if not self.drop_last:
    pad = self.total_size - len(indices)
    while pad > 0:
        take = indices[:pad]
        indices += take
        pad -= len(take)
else:
    indices = indices[:self.total_size]
assert len(indices) == self.total_size
return iter(indices[self.rank:self.total_size:self.num_replicas])
""",
            }),
        'w_pad_from_end': dict(
            mistake='pads by repeating from the END (indices[-pad:])',
            ranks=2, alone=False, verdict='named',
            said="the order is stock's, what pads it is not: stock pads to total_size",
            bodies={
                'ShardSampler.__iter__': """\
if self.shuffle:
    g = torch.Generator()
    g.manual_seed(self.seed + self.epoch)
    indices = torch.randperm(len(self.dataset), generator=g).tolist()
else:
    indices = list(range(len(self.dataset)))
if not self.drop_last:
    pad = self.total_size - len(indices)
    while pad > 0:
        take = indices[-pad:]
        indices += take
        pad -= len(take)
else:
    indices = indices[:self.total_size]
assert len(indices) == self.total_size
return iter(indices[self.rank:self.total_size:self.num_replicas])
""",
            }),
        'w_pad_once': dict(
            mistake='pad with indices[:pad] once (short when pad > n)',
            ranks=3, alone=False, verdict='named',
            said="rank 2 gets 0 indices, stock's 1: every rank must get as many (pad by",
            bodies={
                'ShardSampler.__iter__': """\
if self.shuffle:
    g = torch.Generator()
    g.manual_seed(self.seed + self.epoch)
    indices = torch.randperm(len(self.dataset), generator=g).tolist()
else:
    indices = list(range(len(self.dataset)))
if not self.drop_last:
    pad = self.total_size - len(indices)
    indices += indices[:pad]
else:
    indices = indices[:self.total_size]
return iter(indices[self.rank:self.total_size:self.num_replicas])
""",
            }),
    },
    'tp': {
        'w_bias_full': dict(
            mistake='whole bias added on every rank before the sum',
            ranks=2, alone=False, verdict='named',
            said="the output holds the row split's bias 2 times: every rank adds all of",
            bodies={
                'ColwiseParallel._whole': """\
if self.sequence_dim is not None:
    return gather_sequence(x, self.sequence_dim, group)
if region is not None and region.gave(name, x):
    return x  # the gather's backward already sums the ranks' gradients
return copy_to_ranks(x, group)
""",
                'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
bias = None if module.bias is None else module.bias
partial = F.linear(x, module.weight, bias)
if self.sequence_dim is not None:
    return scatter_sequence(partial, self.sequence_dim, group)
return sum_over_ranks(partial, group)
""",
            }),
        'w_ignore_region': dict(
            mistake='ignores region.gave (copy_to_ranks after a PrepareModuleInput gather)',
            ranks=2, alone=False, verdict='named',
            said="the column split's input was gathered already, by PrepareModuleInput (region.gave(name, x) is True)",
            bodies={
                'ColwiseParallel._whole': """\
if self.sequence_dim is not None:
    return gather_sequence(x, self.sequence_dim, group)
return copy_to_ranks(x, group)
""",
                'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
bias = None if module.bias is None else ShareOfBias.apply(module.bias, ws)
partial = F.linear(x, module.weight, bias)
if self.sequence_dim is not None:
    return scatter_sequence(partial, self.sequence_dim, group)
return sum_over_ranks(partial, group)
""",
            }),
        'w_no_copy_to_ranks': dict(
            mistake='column split returns x (input gradient not summed)',
            ranks=2, alone=False, verdict='named',
            said="rank 1's input gradient differs from rank 0's, where stock's is the",
            bodies={
                'ColwiseParallel._whole': """\
if self.sequence_dim is not None:
    return gather_sequence(x, self.sequence_dim, group)
if region is not None and region.gave(name, x):
    return x  # the gather's backward already sums the ranks' gradients
return x
""",
                'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
bias = None if module.bias is None else ShareOfBias.apply(module.bias, ws)
partial = F.linear(x, module.weight, bias)
if self.sequence_dim is not None:
    return scatter_sequence(partial, self.sequence_dim, group)
return sum_over_ranks(partial, group)
""",
            }),
        'w_no_sum': dict(
            mistake='row split returns the partial output (no sum_over_ranks)',
            ranks=2, alone=False, verdict='named',
            said="rank 1's output differs from rank 0's, where stock's is the same on",
            bodies={
                'ColwiseParallel._whole': """\
if self.sequence_dim is not None:
    return gather_sequence(x, self.sequence_dim, group)
if region is not None and region.gave(name, x):
    return x  # the gather's backward already sums the ranks' gradients
return copy_to_ranks(x, group)
""",
                'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
bias = None if module.bias is None else ShareOfBias.apply(module.bias, ws)
partial = F.linear(x, module.weight, bias)
if self.sequence_dim is not None:
    return scatter_sequence(partial, self.sequence_dim, group)
return partial
""",
            }),
        'w_seq_copy_too': dict(
            mistake='sequence parallel: gather_sequence then copy_to_ranks too (input grad summed twice)',
            ranks=2, alone=False, verdict='named',
            said="2.000x stock's, 3 of 8 gradients: the ranks' partial values summed",
            bodies={
                'ColwiseParallel._whole': """\
if self.sequence_dim is not None:
    x = gather_sequence(x, self.sequence_dim, group)
if region is not None and region.gave(name, x):
    return x
return copy_to_ranks(x, group)
""",
                'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
bias = None if module.bias is None else ShareOfBias.apply(module.bias, ws)
partial = F.linear(x, module.weight, bias)
if self.sequence_dim is not None:
    return scatter_sequence(partial, self.sequence_dim, group)
return sum_over_ranks(partial, group)
""",
            }),
        'w_seq_sum_not_scatter': dict(
            mistake='sequence_dim ignored in row split (sum instead of scatter)',
            ranks=2, alone=False, verdict='named',
            said="the output's shape (4, 8, 16) is not stock's (4, 4, 16): it holds the",
            bodies={
                'ColwiseParallel._whole': """\
if self.sequence_dim is not None:
    return gather_sequence(x, self.sequence_dim, group)
if region is not None and region.gave(name, x):
    return x  # the gather's backward already sums the ranks' gradients
return copy_to_ranks(x, group)
""",
                'RowwiseParallel._forward': """\
ws = dist.get_world_size(group)
bias = None if module.bias is None else ShareOfBias.apply(module.bias, ws)
partial = F.linear(x, module.weight, bias)
return sum_over_ranks(partial, group)
""",
            }),
    },
    'zero': {
        'w_counts_restart': dict(
            mistake='element counts reset for each param group',
            ranks=2, alone=False, verdict='caught',
            said="the shards are not stock's: largest parameters first, each to the",
            bodies={
                'ShardedOptimizer._shards': """\
partition = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    held = [0] * self.world_size
    mine = [[] for _ in range(self.world_size)]
    for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
        r = held.index(min(held))  # fewest elements; lowest rank on a tie
        mine[r].append(p)
        held[r] += p.numel()
    for r in range(self.world_size):
        shard = {k: v for k, v in group.items() if k != "params"}
        shard["params"] = mine[r]
        partition[r].append(shard)
return partition
""",
                'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
for owner, groups in enumerate(self.partition):
    for g in groups:
        for p in g["params"]:
            dist.broadcast(p.data, src=global_rank(self.process_group, owner),
                           group=self.process_group)
return loss
""",
            }),
        'w_no_broadcast_others': dict(
            mistake='each rank broadcasts only its own shard (mismatched collectives)',
            ranks=2, alone=True, verdict='named', hangs=True,
            said='every rank waits in broadcast, called with other src',
            bodies={
                'ShardedOptimizer._shards': """\
held = [0] * self.world_size  # elements per rank, carried across groups
partition = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    mine = [[] for _ in range(self.world_size)]
    for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
        r = held.index(min(held))  # fewest elements; lowest rank on a tie
        mine[r].append(p)
        held[r] += p.numel()
    for r in range(self.world_size):
        shard = {k: v for k, v in group.items() if k != "params"}
        shard["params"] = mine[r]
        partition[r].append(shard)
return partition
""",
                'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
# only my shard changed: send it to the others
for g in self.partition[self.rank]:
    for p in g["params"]:
        dist.broadcast(p.data, src=global_rank(self.process_group, self.rank), group=self.process_group)
return loss
""",
            }),
        'w_round_robin': dict(
            mistake='i % world_size assignment',
            ranks=2, alone=False, verdict='named',
            said="the shards are not stock's: largest parameters first, each to the",
            bodies={
                'ShardedOptimizer._shards': """\
held = [0] * self.world_size
partition = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    mine = [[] for _ in range(self.world_size)]
    for i, p in enumerate(group["params"]):
        r = i % self.world_size
        mine[r].append(p)
        held[r] += p.numel()
    for r in range(self.world_size):
        shard = {k: v for k, v in group.items() if k != "params"}
        shard["params"] = mine[r]
        partition[r].append(shard)
return partition
""",
                'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
for owner, groups in enumerate(self.partition):
    for g in groups:
        for p in g["params"]:
            dist.broadcast(p.data, src=global_rank(self.process_group, owner),
                           group=self.process_group)
return loss
""",
            }),
        'w_smallest_first': dict(
            mistake='ascending sort',
            ranks=2, alone=False, verdict='named',
            said="the shards are not stock's: largest parameters first, each to the",
            bodies={
                'ShardedOptimizer._shards': """\
held = [0] * self.world_size  # elements per rank, carried across groups
partition = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    mine = [[] for _ in range(self.world_size)]
    for p in sorted(group["params"], key=lambda t: t.numel()):
        r = held.index(min(held))  # fewest elements; lowest rank on a tie
        mine[r].append(p)
        held[r] += p.numel()
    for r in range(self.world_size):
        shard = {k: v for k, v in group.items() if k != "params"}
        shard["params"] = mine[r]
        partition[r].append(shard)
return partition
""",
                'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
for owner, groups in enumerate(self.partition):
    for g in groups:
        for p in g["params"]:
            dist.broadcast(p.data, src=global_rank(self.process_group, owner),
                           group=self.process_group)
return loss
""",
            }),
        'w_src_grouprank': dict(
            mistake='broadcast src=owner (group rank) without global_rank',
            ranks=3, alone=True, verdict='named',
            said='src and dst are global ranks',
            bodies={
                'ShardedOptimizer._shards': """\
held = [0] * self.world_size  # elements per rank, carried across groups
partition = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    mine = [[] for _ in range(self.world_size)]
    for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
        r = held.index(min(held))  # fewest elements; lowest rank on a tie
        mine[r].append(p)
        held[r] += p.numel()
    for r in range(self.world_size):
        shard = {k: v for k, v in group.items() if k != "params"}
        shard["params"] = mine[r]
        partition[r].append(shard)
return partition
""",
                'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
for owner, groups in enumerate(self.partition):
    for g in groups:
        for p in g["params"]:
            dist.broadcast(p.data, src=owner,
                           group=self.process_group)
return loss
""",
            }),
        'w_tie_highest': dict(
            mistake='ties go to the highest rank',
            ranks=2, alone=False, verdict='named',
            said="the shards are not stock's: largest parameters first, each to the",
            bodies={
                'ShardedOptimizer._shards': """\
held = [0] * self.world_size  # elements per rank, carried across groups
partition = [[] for _ in range(self.world_size)]
for group in self.param_groups:
    mine = [[] for _ in range(self.world_size)]
    for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
        r = max(range(self.world_size), key=lambda k: (-held[k], k))
        mine[r].append(p)
        held[r] += p.numel()
    for r in range(self.world_size):
        shard = {k: v for k, v in group.items() if k != "params"}
        shard["params"] = mine[r]
        partition[r].append(shard)
return partition
""",
                'ShardedOptimizer.step': """\
loss = self.optim.step(closure)
for owner, groups in enumerate(self.partition):
    for g in groups:
        for p in g["params"]:
            dist.broadcast(p.data, src=global_rank(self.process_group, owner),
                           group=self.process_group)
return loss
""",
            }),
    },
    'zero_bubble': {
        'wrong_bubble_moves_on': dict(
            mistake='on a bubble the rank skips the waiting forward (action lost)',
            ranks=2, alone=False, verdict='named',
            said="rank 0's list changed: 2F0 (stage 2's forward of microbatch 0) is",
            bodies={
                'add_bubbles': """\
# TODO (add_bubbles): stock's _add_bubbles_to_actions: a new list per rank, built a slot
# at a time while some rank's list is not used up; in each slot, rank 0 first, each such
# rank takes its next action: None is copied (the rank moves on); a forward "sFi" with s >
# 0 whose input "(s-1)Fi" was not placed in an EARLIER slot gets None instead (the rank
# stays on it); any other action is copied (the rank moves on). What a slot places counts
# as done only from the next slot. Actions are never changed or reordered, only delayed.
result = [[] for _ in lists]
at = [0] * len(lists)
placed = set()  # the forwards placed in earlier slots
while any(at[r] < len(lists[r]) for r in range(len(lists))):
    this_slot = set()
    for r, actions in enumerate(lists):
        if at[r] >= len(actions):
            continue
        action = actions[at[r]]
        if action is not None:
            s, kind, i = parse_action(action)
            if kind == "F" and s > 0 and f"{s - 1}F{i}" not in placed:
                result[r].append(None)
                at[r] += 1
                continue
            this_slot.add(action)
        result[r].append(action)
        at[r] += 1
    placed |= this_slot
return result
""",
            }),
        'wrong_drop_none': dict(
            mistake="the input's None slots dropped instead of copied",
            ranks=2, alone=False, verdict='named',
            said="rank 1's list has a None of its own here (its entry 0): a None in a",
            bodies={
                'add_bubbles': """\
# TODO (add_bubbles): stock's _add_bubbles_to_actions: a new list per rank, built a slot
# at a time while some rank's list is not used up; in each slot, rank 0 first, each such
# rank takes its next action: None is copied (the rank moves on); a forward "sFi" with s >
# 0 whose input "(s-1)Fi" was not placed in an EARLIER slot gets None instead (the rank
# stays on it); any other action is copied (the rank moves on). What a slot places counts
# as done only from the next slot. Actions are never changed or reordered, only delayed.
result = [[] for _ in lists]
at = [0] * len(lists)
placed = set()  # the forwards placed in earlier slots
while any(at[r] < len(lists[r]) for r in range(len(lists))):
    this_slot = set()
    for r, actions in enumerate(lists):
        if at[r] >= len(actions):
            continue
        action = actions[at[r]]
        if action is None:
            at[r] += 1
            continue
        if action is not None:
            s, kind, i = parse_action(action)
            if kind == "F" and s > 0 and f"{s - 1}F{i}" not in placed:
                result[r].append(None)
                continue
            this_slot.add(action)
        result[r].append(action)
        at[r] += 1
    placed |= this_slot
return result
""",
            }),
        'wrong_same_slot': dict(
            mistake="a slot's placements count within the same slot",
            ranks=2, alone=False, verdict='named',
            said="yours runs 3F0 (stage 3's forward of microbatch 0) at slot 2, where",
            bodies={
                'add_bubbles': """\
# TODO (add_bubbles): stock's _add_bubbles_to_actions: a new list per rank, built a slot
# at a time while some rank's list is not used up; in each slot, rank 0 first, each such
# rank takes its next action: None is copied (the rank moves on); a forward "sFi" with s >
# 0 whose input "(s-1)Fi" was not placed in an EARLIER slot gets None instead (the rank
# stays on it); any other action is copied (the rank moves on). What a slot places counts
# as done only from the next slot. Actions are never changed or reordered, only delayed.
result = [[] for _ in lists]
at = [0] * len(lists)
placed = set()  # the forwards placed in earlier slots
while any(at[r] < len(lists[r]) for r in range(len(lists))):
    this_slot = set()
    for r, actions in enumerate(lists):
        if at[r] >= len(actions):
            continue
        action = actions[at[r]]
        if action is not None:
            s, kind, i = parse_action(action)
            if kind == "F" and s > 0 and f"{s - 1}F{i}" not in placed:
                result[r].append(None)
                continue
            placed.add(action)
        result[r].append(action)
        at[r] += 1
    placed |= this_slot
return result
""",
            }),
        'wrong_stop_early': dict(
            mistake="loop stops when ANY rank's list is used up (all instead of any)",
            ranks=2, alone=False, verdict='named',
            said="rank 1's list changed: 1W0 (stage 1's weights' gradient of microbatch",
            bodies={
                'add_bubbles': """\
# TODO (add_bubbles): stock's _add_bubbles_to_actions: a new list per rank, built a slot
# at a time while some rank's list is not used up; in each slot, rank 0 first, each such
# rank takes its next action: None is copied (the rank moves on); a forward "sFi" with s >
# 0 whose input "(s-1)Fi" was not placed in an EARLIER slot gets None instead (the rank
# stays on it); any other action is copied (the rank moves on). What a slot places counts
# as done only from the next slot. Actions are never changed or reordered, only delayed.
result = [[] for _ in lists]
at = [0] * len(lists)
placed = set()  # the forwards placed in earlier slots
while all(at[r] < len(lists[r]) for r in range(len(lists))):
    this_slot = set()
    for r, actions in enumerate(lists):
        if at[r] >= len(actions):
            continue
        action = actions[at[r]]
        if action is not None:
            s, kind, i = parse_action(action)
            if kind == "F" and s > 0 and f"{s - 1}F{i}" not in placed:
                result[r].append(None)
                continue
            this_slot.add(action)
        result[r].append(action)
        at[r] += 1
    placed |= this_slot
return result
""",
            }),
        'wrong_wait_previous_stage_any_kind': dict(
            mistake="every kind (also I/W) waits for the previous stage's same kind -> add_bubbles never terminates (pure-Python infinite loop)",
            ranks=2, alone=False, verdict='named',
            said="rank 0 waits forever before 2I0 (stage 2's input's gradient of microbatch 0): only a forward waits",
            bodies={
                'add_bubbles': """\
# TODO (add_bubbles): stock's _add_bubbles_to_actions: a new list per rank, built a slot
# at a time while some rank's list is not used up; in each slot, rank 0 first, each such
# rank takes its next action: None is copied (the rank moves on); a forward "sFi" with s >
# 0 whose input "(s-1)Fi" was not placed in an EARLIER slot gets None instead (the rank
# stays on it); any other action is copied (the rank moves on). What a slot places counts
# as done only from the next slot. Actions are never changed or reordered, only delayed.
result = [[] for _ in lists]
at = [0] * len(lists)
placed = set()  # the forwards placed in earlier slots
while any(at[r] < len(lists[r]) for r in range(len(lists))):
    this_slot = set()
    for r, actions in enumerate(lists):
        if at[r] >= len(actions):
            continue
        action = actions[at[r]]
        if action is not None:
            s, kind, i = parse_action(action)
            if s > 0 and f"{s - 1}{kind}{i}" not in placed:
                result[r].append(None)
                continue
            this_slot.add(action)
        result[r].append(action)
        at[r] += 1
    placed |= this_slot
return result
""",
            }),
    },
}
