"""FSDP by hand (ZeRO-3): each rank keeps a shard of every weight, gathers a layer just in time.

    torchrun --nproc_per_node=2 examples/fsdp.py --grad-table runs/fsdp.txt
    pytest tests/test_fsdp.py                 # each rank's shards are fully_shard's, 1-4 ranks

DDP keeps the whole model on every rank; ZeRO-1 shards the optimizer state; FSDP the weights:
  shard           cut each parameter into world_size blocks of rows; a rank keeps one, as a
                  DTensor, so torch's utilities still see the whole weight (as_dtensor)
  unshard         before a unit (a module given to fully_shard) runs, one all_gather puts the
                  blocks together into whole weights;  reshard: right after, free them
  hooks           before the unit's backward, unshard again; when it is done, reduce:
  reduce_scatter  sum the unit's gradients over ranks, hand each rank its block's rows
Use it as stock's: fully_shard(block) per block, fully_shard(model), then build the optimizer.
Mixed precision and the rest of stock's API: dropin/fsdp.py (`minddp.fully_shard`).
"""

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.utils._pytree import tree_flatten

from .param import Param, attach_unit, owned_by, unit_of
from ..ddp.grad_hooks import after_backward_of, at_end_of_backward
from ..launch.groups import global_rank


def fully_shard(module, *, reshard_after_forward=None, process_group=None):
    """Collective: shard `module`'s parameters (those not in an inner unit) over the ranks."""
    return attach_unit(module, Unit(module, reshard_after_forward, process_group))


class Unit:
    """The parameters of one fully_shard call: one all_gather, one reduce_scatter for all."""

    def __init__(self, module, reshard_after_forward, group):
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        device = next((p.device for p in module.parameters() if not p.is_meta), "cpu")
        # The shards are DTensors (as_dtensor): they need the group as a 1-D device mesh.
        self.mesh = DeviceMesh.from_group(group or dist.group.WORLD, torch.device(device).type)
        self.inner = [unit_of(m) for m in module.modules() if unit_of(m) is not None]
        self.params = [self.shard(*owned) for owned in self.owned_parameters()]
        self.is_unsharded, self._backward_done, self._callback_queued = False, True, False
        # The root, until an outer unit claims this one: it ends every backward (units).
        self.root, self.units = self, [self, *self.inner]
        for unit in self.inner:  # reshard_after_forward: by default, all but the root's
            unit.root, unit.units = self, []
            unit.reshard_after_forward = unit.reshard_after_forward is not False
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    def owned_parameters(self):
        """(name, [(module, attribute)], parameter) for the parameters not in an inner unit."""
        return owned_by(self.module, [unit.module for unit in self.inner])

    @torch.no_grad()
    def shard(self, name, users, param):
        """Collective: rank 0's weights to every rank (as DDP starts); keep our rows."""
        if self.world_size > 1 and not param.is_meta:  # (meta: no values yet, see dropin)
            dist.broadcast(param, src=global_rank(self.group, 0), group=self.group)
        rows = math.ceil(param.shape[0] / self.world_size)  # torch.chunk's block: the last
        start = min(self.rank * rows, param.shape[0])       # blocks may be short or empty
        # The whole weight the module computes with: same shape, storage freed between uses.
        full = torch.nn.Parameter(torch.empty_like(param), param.requires_grad)
        full.untyped_storage().resize_(0)
        shard = torch.nn.Parameter(self.as_dtensor(param[start:start + rows].clone(), full),
                                   param.requires_grad)
        p = Param(name, users, shard, full, rows, rows * math.prod(param.shape[1:]))
        p.show(shard)  # the model's parameters are now the shards
        return p

    def as_dtensor(self, block, full):
        """Our rows of `full` as a DTensor, Shard(0) of full's shape on the mesh. Why: on a
        plain block, clip_grad_norm_ clips each rank by its own rows' norm, not the whole's."""
        return DTensor.from_local(block, self.mesh, [Shard(0)], run_check=False,
                                  shape=full.shape, stride=full.stride())

    @torch.no_grad()
    def unshard(self):
        """Collective: all_gather the unit's blocks; the module then holds whole weights."""
        if self.is_unsharded or not self.params:  # (a root may have no parameters of its own)
            return
        # One flat buffer, each block padded to `rows` rows: one collective, equal pieces.
        sizes = [p.block_numel for p in self.params]
        gathered = self.params[0].full.new_empty(self.world_size * sum(sizes))
        flat = gathered.view(self.world_size, -1)[self.rank]  # our slot: gathered in place
        for p, piece in zip(self.params, flat.split(sizes)):
            block = p.shard.to_local()  # the DTensor's rows on this rank (a plain tensor)
            piece[:block.numel()].copy_(block.reshape(-1))
            piece[block.numel():].zero_()  # the padding rows
        if self.world_size > 1:
            dist.all_gather_single(gathered, flat, group=self.group)  # (2.13's name; the old
            # one, all_gather_into_tensor, still runs but warns)
        pieces = gathered.view(self.world_size, -1).split(sizes, dim=1)
        for p, piece in zip(self.params, pieces):
            p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
            # piece[r] is rank r's block. `.data` writes without bumping the version counter:
            # autograd saved `full` in an earlier forward and must find it refilled in backward.
            for r, block in enumerate(p.full.data.view(-1).split(p.block_numel)):
                block.copy_(piece[r, :block.numel()])
            p.show(p.full)
        self.is_unsharded = True

    def reshard(self):
        """Free the whole weights' memory; the module holds its blocks again."""
        if self.is_unsharded:
            for p in self.params:
                # The tensor stays (autograd holds it); its bytes go.
                p.full.untyped_storage().resize_(0)
                p.show(p.shard)
            self.is_unsharded = False

    def _pre_forward(self, module, args, kwargs):
        self.unshard()
        # Gradients reach the unit's inputs last: when all have come, its backward is done.
        unit = weakref.ref(self)  # (autograd may hold the node longer than the model lives)
        return after_backward_of((args, kwargs), lambda: unit().post_backward())  # grad_hooks

    def _post_forward(self, module, args, output):
        if self.reshard_after_forward:
            self.reshard()
        if torch.is_grad_enabled():
            unit = weakref.ref(self)
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:  # backward enters the unit here
                    t.register_hook(lambda grad: unit()._pre_backward(grad))
            self._backward_done = False
        return output

    def _pre_backward(self, grad):
        if not self._backward_done:  # (the first of the unit's outputs to get its gradient)
            self.unshard()  # gathered again: the weights were freed after forward
            if not self.root._callback_queued:  # once per backward: after autograd's last node
                self.root._callback_queued = True
                at_end_of_backward(self.root._end_of_backward)  # (grad_hooks.py)
        return grad

    def post_backward(self):
        """Collective: reduce_scatter the unit's gradients into its blocks' .grad; reshard."""
        if self._backward_done:
            return  # (the hook on the inputs already did, before the end of backward)
        self._backward_done = True
        ready = [p for p in self.params if p.full.grad is not None]
        self.reshard()
        blocks = self.reduce_scatter(ready, [p.full.grad for p in ready]) if ready else []
        for p, grad in zip(ready, blocks):
            p.full.grad = None  # the whole gradient is freed: only the block's rows stay
            p.shard.grad = grad if p.shard.grad is None else p.shard.grad + grad

    def _end_of_backward(self):
        # Units whose inputs need no gradient (the first block, the root) hook no inputs: now.
        self._callback_queued = False
        for unit in reversed(self.units):
            unit.post_backward()
            # Done for this backward: the next one (a pipeline's next microbatch, whose
            # forward may have run long before) starts anew.
            unit._backward_done = False

    @torch.no_grad()
    def reduce_scatter(self, params, grads):
        """Collective: sum each whole gradient over ranks; our rows, averaged (as DTensors)."""
        # Laid out as the all_gather's: row r of `flat` holds every parameter's block r.
        flat = torch.cat([F.pad(g.reshape(len(g), -1), (0, 0, 0, p.rows * self.world_size - len(g)))
                          .view(self.world_size, -1) for p, g in zip(params, grads)], dim=1)
        mine = flat.view(-1) if self.world_size == 1 else flat.new_empty(flat.shape[1])
        if self.world_size > 1:
            # AVG, as stock asks (gloo sums, then divides; DDP scales first, then sums).
            dist.reduce_scatter_single(mine, flat.view(-1), dist.ReduceOp.AVG, self.group)
        pieces = mine.split([p.block_numel for p in params])  # our rows, then padding
        return [self.as_dtensor(piece[:p.shard.to_local().numel()].view_as(p.shard.to_local()),
                                p.full) for p, piece in zip(params, pieces)]
