"""Gradient tables: every synchronized gradient, at every step, on every rank, on disk.

    torchrun --nproc_per_node=2 examples/manual_ddp.py --grad-table manual.txt
    torchrun --nproc_per_node=2 examples/stock_ddp.py  --grad-table stock.txt
    minddp diff manual.txt stock.txt

Call `record()` right after `loss.backward()`: that is when DDP's promise is due (every
.grad is the average over ranks), so on every rank the rows of one step must be equal,
and two DDP implementations must agree row by row. `save()` gathers all ranks' rows to
rank 0, which writes two files:

    PATH      a table for people (tabulate): step, epoch, rank, parameter, norm, digest
    PATH.npz  every element, exactly (numpy arrays [step, rank, *shape] per parameter),
              which is what `minddp diff` compares (the format: tables.py)
"""

import sys

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError
from .tables import TableError, read_table, write_table  # noqa: F401  (the file format)

def _to_numpy(t):
    t = t.detach().cpu()
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly.
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


class GradTable:
    """Records `model`'s gradients; a no-op when `path` is None, so a loop can always call it.

    `model` may be the wrapper (stock DDP or ManualDDP): names are taken from its
    `.module`, so both wrappers give the same names ("layers.0.weight").
    """

    def __init__(self, model, path=None, rank0_only=False):
        """Record `model`'s gradients for a table at `path` (None: record nothing).

        rank0_only: keep rank 0's rows alone, with the world size of each step (an elastic
        run, whose world size changes; its ranks hold the same averaged gradient anyway).
        """
        self.module = getattr(model, "module", model)
        # Named now, as the optimizer holds them: stock's DDP over TP swaps each TP weight for
        # a local Parameter and, in forward, puts a DTensor made from it in its place.
        self.named = dict(self.module.named_parameters())
        self.path, self.rank0_only = path, rank0_only
        self.rows = []  # (step, epoch, {name: gradient})
        self.world_sizes = []  # per step, with rank0_only

    def record(self, epoch=-1):
        if self.path is None:
            return
        grads = {}
        named = {**self.named, **dict(self.module.named_parameters())}  # now's, where listed
        experts = _expert_gradients(self.module)  # expert parallel: each from its rank
        whole = {**_whole_gradients(self.module, named), **experts}
        for name, p in named.items():
            if not p.requires_grad:
                continue  # frozen: no gradient to compare
            # A trainable parameter with no gradient this step is recorded as NaN, so the
            # table keeps one row per parameter and step and the gap shows up in a diff.
            g = whole[name]
            if g is None:
                g = torch.full(p.shape, float("nan"))
            grads[name] = _to_numpy(g)
        for name in (n for n in experts if n not in named):  # others' experts (ep/parallel.py): a
            grads[name] = _to_numpy(experts[name])  # table made after expert_parallel
        if self.rank0_only and _rank() != 0:
            return
        self.rows.append((len(self.rows), epoch, grads))
        self.world_sizes.append(_world_size())

    def gather(self):
        """Collective: every rank's rows, on rank 0 (None elsewhere)."""
        if self.rank0_only:
            return [self.rows] if _rank() == 0 else None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [self.rows]
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self.rows, gathered, dst=0)
        return gathered

    def save(self):
        """Collective: every rank calls it; rank 0 writes PATH and PATH.npz."""
        if self.path is None:
            return
        rows_by_rank = self.gather()
        if rows_by_rank is not None:
            write_table(self.path, rows_by_rank,
                        world_sizes=self.world_sizes if self.rank0_only else None)
            print(f"gradient table: {self.path} (every element: {self.path}.npz)", flush=True)

    def state_dict(self):
        """Collective: call on every rank. Every rank's rows so far, on rank 0 (for checkpoints).

        Rows are stored as tensors, which torch.load(weights_only=True) accepts.
        """
        rows_by_rank = self.gather() if self.path else None
        if rows_by_rank is not None:
            rows_by_rank = [[(s, e, {n: torch.from_numpy(a) for n, a in g.items()})
                             for s, e, g in rows] for rows in rows_by_rank]
        if self.rank0_only:  # no collective: rank 0 holds all there is
            return {"world_size": None, "rows_by_rank": rows_by_rank,
                    "world_sizes": list(self.world_sizes)}
        if rows_by_rank is None:
            return {"world_size": _world_size(), "rows_by_rank": None}
        return {"world_size": len(rows_by_rank), "rows_by_rank": rows_by_rank}

    def load_state_dict(self, state):
        """This rank's rows from a state_dict(); the world size must be the same."""
        if not self.path:
            return
        if self.rank0_only:  # any world size: the rows are rank 0's, and stay there
            if _rank() == 0 and state.get("rows_by_rank"):
                self.rows = _as_numpy(state["rows_by_rank"][0])
                self.world_sizes = list(state["world_sizes"])
            return
        if state["rows_by_rank"] is None or state["world_size"] != _world_size():
            raise UsageError(
                f"cannot continue the gradient table: the checkpoint was saved at world size"
                f" {state['world_size']} {'without' if state['rows_by_rank'] is None else 'with'}"
                f" a table, this run has world size {_world_size()}",
                hint="resume with the same --nproc_per_node and --grad-table, or start afresh",
                same_on_every_rank=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.rows = _as_numpy(state["rows_by_rank"][rank])


def _as_numpy(rows):
    return [(s, e, {n: t.cpu().numpy() for n, t in g.items()}) for s, e, g in rows]


def _whole_gradients(module, named):
    """{name: gradient} of the parameters `named`; a sharded model's whole gradients,
    gathered: a collective then."""
    # Only a model that minddp's fully_shard or parallelize_module made has units or slices,
    # and then their lesson is imported already (asked otherwise, it would import DTensor).
    fsdp, tp_plan = sys.modules.get("minddp.fsdp.shard"), sys.modules.get("minddp.tp.plan")
    cuts = tp_plan.sliced(module) if tp_plan is not None else {}
    if fsdp is not None and any(fsdp.unit_of(m) is not None for m in module.modules()):
        from .whole_tensors import full_gradients
        whole = full_gradients(module)  # each shard's dp blocks gathered: a TP slice, or all
    else:  # stock's DTensors (fully_shard, parallelize_module): full_tensor() gathers one
        whole = {name: _stock_whole(p) for name, p in named.items()}
    # minddp's tensor-parallel slices (tp/parallel.py), gathered along the dimension they were cut.
    whole = {name: _gather_slices(g, *cuts[name]) if name in cuts and g is not None else g
             for name, g in whole.items()}
    return whole


def _expert_gradients(module):
    """{name: gradient} of every expert of expert-parallel layers (ep/parallel.py), each
    gathered from the ep rank that holds it: a collective. NaN where an expert had no gradient."""
    ep = sys.modules.get("minddp.ep.parallel")
    if ep is None:
        return {}
    whole = {}
    for prefix, m in module.named_modules():
        if not isinstance(m, ep.ExpertsOnRanks):
            continue
        for i, mlp in enumerate(m.mlps.values()):  # slot i: expert j * per_rank + i on rank j
            for suffix, p in mlp.named_parameters():
                g = p.grad if p.grad is not None else torch.full_like(p, float("nan"))
                parts = [torch.empty_like(g) for _ in range(m.num_experts // m.per_rank)]
                dist.all_gather(parts, g.detach().contiguous(), group=m.group)
                for j, part in enumerate(parts):
                    whole[f"{prefix}.mlps.{j * m.per_rank + i}.{suffix}"] = part
    return whole


def _stock_whole(p):
    if hasattr(p.grad, "full_tensor"):
        return p.grad.full_tensor()
    spec = getattr(p, "_st_info", None)  # stock DDP over TP: a DTensor's local Parameter
    if spec is not None and p.grad is not None:
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(p.grad, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride).full_tensor()
    return p.grad


def _gather_slices(grad, dim, group):
    slices = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slices, grad.contiguous(), group=group)
    return torch.cat(slices, dim)


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0
