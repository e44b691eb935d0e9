"""The tensor-parallel check: the student's column and row splits beside stock's.

    minddp grade exercises/tp.py --ranks 2

A replicated layer, then the column split (up) and the row split (down), three AdamW steps:
the output, the input's gradient, every whole gradient and weight, every step, bit for bit.
A run a rounding apart from stock's that is bit for bit the textbook's placement of the row
split's bias (once, after the sum; stock: bias / W on every rank, before it) is `correct`.
"""

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
# Stock's references, imported before any process group exists: importing stock's parallel
# packages after init_process_group can keep the group alive past its destroy.
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.distributed.tensor import parallel as stock_tp

from ..judge.diagnosis import compare
from ..shared.training import STEPS, _everyone, _np, _ranks, _result, _runs, _whole


class _MLP(torch.nn.Module):
    """A replicated layer, then the column split (up) and the row split (down)."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = torch.nn.Linear(d, 4 * d)
        self.up, self.down = torch.nn.Linear(4 * d, 8 * d), torch.nn.Linear(8 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(torch.tanh(self.embed(x)))))


class _UpDown(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4 * d, 8 * d), torch.nn.Linear(8 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _Gathered(torch.nn.Module):
    """A replicated layer on each rank's slice of the sequence, then a block whose input
    PrepareModuleInput gathers: the column split inside takes the gathered input."""

    def __init__(self, d=16):
        super().__init__()
        self.embed, self.block = torch.nn.Linear(d, 4 * d), _UpDown(d)

    def forward(self, x):
        return self.block(torch.tanh(self.embed(x)))


def _bias_after_sum(rowwise, **layouts):
    """The lesson's RowwiseParallel with the textbook's bias: added once, after the sum (stock
    adds bias / W on every rank, before it): right too, and another rounding."""
    from ...tp.ops import scatter_sequence, sum_over_ranks

    class BiasAfterSum(rowwise):
        def _forward(self, module, x, group):
            partial = F.linear(x, module.weight)
            out = (scatter_sequence(partial, self.sequence_dim, group)
                   if self.sequence_dim is not None else sum_over_ranks(partial, group))
            return out if module.bias is None else out + module.bias
    return BiasAfterSum(**layouts)


def tp(student, rank, world_size):
    """The student's column and row splits against stock's parallelize_module: the output,
    the input's gradient, every whole gradient and weight, every step; then the same with
    sequence parallelism (each rank a slice of the sequence: gathered before up, the sum
    reduce_scattered after down). A run a rounding apart is also compared with the
    textbook's bias placement (_bias_after_sum)."""
    return [_check(student, rank, world_size, sequence=False),
            _check(student, rank, world_size, sequence=True),
            _check(student, rank, world_size, sequence="gathered")]


def _check(student, rank, world_size, sequence):
    from torch.distributed.tensor import Replicate, Shard
    from ...mesh.device_mesh import init_device_mesh
    from ...tp import parallel as lesson
    from ...tp.plan import sliced
    from ...tp.sequence_parallel import PrepareModuleInput
    gathered = sequence == "gathered"  # the block's input gathered, then a plain column split
    col, row = ({} if gathered else {"input_layouts": Shard(1)}, {"output_layouts": Shard(1)}) \
        if sequence else ({}, {})
    at = "block." if gathered else ""
    torch.manual_seed(0)
    model = _Gathered() if gathered else _MLP()
    stock, textbook = copy.deepcopy(model), copy.deepcopy(model)
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}

    def parallelized(who, m, library, mesh, rowwise):
        plan = {f"{at}up": library.ColwiseParallel(**col), f"{at}down": rowwise(**row)}
        if gathered:
            plan["block"] = (stock_tp.PrepareModuleInput if who == "stock" else
                             PrepareModuleInput)(**gather)
        library.parallelize_module(m, mesh("cpu", (world_size,)), plan)
        return m

    def whole(name, t, cuts):  # cuts: the model's slices, (dim, group) per parameter name
        if t is None or name not in cuts:
            return _np(_whole(t))
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.detach().contiguous(), group=cuts[name][1])
        return _np(torch.cat(parts, cuts[name][0]))

    def run(who, m):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        mine = sliced(m) if who != "stock" else {}  # (stock's are DTensors: _whole)
        record = {"start": {n: whole(n, p, mine) for n, p in m.named_parameters()},
                  "grads": [], "weights": []}
        for step in range(STEPS):
            # the same x on every rank (TP splits the layers, not the batch); with sequence
            # parallelism each rank its own slice of the sequence (dim 1)
            x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(step))
            x = (x.chunk(world_size, 1)[rank] if sequence else x).clone().requires_grad_()
            optimizer.zero_grad()
            out = m(x)
            out.square().mean().backward()
            grads = {n: whole(n, p.grad, mine) for n, p in m.named_parameters()}
            record["grads"].append({"(output)": _np(out), "(the input's gradient)":
                                    _np(x.grad), **grads})
            optimizer.step()
            record["weights"].append({n: whole(n, p, mine) for n, p in m.named_parameters()})
        return record
    model = parallelized("yours", model, student, init_device_mesh, student.RowwiseParallel)
    stock = parallelized("stock", stock, stock_tp, stock_mesh, stock_tp.RowwiseParallel)
    everyone = _everyone({"stock": run("stock", stock), "yours": run("yours", model)})
    label = (f"{_ranks(world_size)}, a replicated layer, then up (column) and down (row)"
             + (", sequence parallel, the block's input gathered by PrepareModuleInput"
                if gathered else ", sequence parallel (Shard(1) in and out)" if sequence
                else "") + ", AdamW")
    shapes = [(r["yours"]["grads"][0]["(output)"].shape, r["stock"]["grads"][0]["(output)"].shape)
              for r in everyone]
    if any(mine != theirs for mine, theirs in shapes):
        rank = next(r for r, (mine, theirs) in enumerate(shapes) if mine != theirs)
        mine, theirs = shapes[rank]
        why = f"the output's shape {tuple(mine)} is not stock's {tuple(theirs)}"
        if sequence and mine[1] == theirs[1] * world_size:
            why += (": it holds the whole sequence. With output_layouts=Shard(1) the row"
                    " split's sum is reduce_scattered along the sequence, each rank keeping"
                    " its slice (scatter_sequence on self.sequence_dim)")
        elif sequence is True and mine[1] * world_size == theirs[1]:
            why += (": the sequence was cut twice. With input_layouts=Shard(1) each rank"
                    " holds a slice, gathered whole before the column split (gather_sequence"
                    " on self.sequence_dim)")
        return _result(label, False, f"step 0, rank {rank}, (output)", why)
    passed, where, why = compare(_runs(everyone, "yours"), _runs(everyone, "stock"), world_size,
                                 "stock adds each rank's share of the row split's bias before"
                                 " the sum")
    why = _in_tp_words(why, where, world_size, gathered)
    if where.endswith("down.bias") and why.startswith("no gradient"):
        why = ("no gradient for this rank's copy of the row split's bias: it was added on one"
               " rank only, so only that rank's copy takes part in the loss, and the copies"
               " part after the first step (stock's is one replicated bias, its gradient whole"
               " on every rank): add bias / world_size on every rank before the sum, as stock,"
               " or the whole bias on every rank after it")
    if "(output)" in where:  # by how much: the row split's bias, once per rank too many?
        extra = everyone[0]["yours"]["grads"][0]["(output)"] - everyone[0]["stock"]["grads"][0][
            "(output)"]
        bias = everyone[0]["stock"]["start"][f"{at}down.bias"]
        if world_size > 1 and abs(extra - (world_size - 1) * bias).max() < 1e-5:
            why = (f"the output holds the row split's bias {world_size} times: every rank adds"
                   f" all of it before the sum (add bias / world_size on each, as stock)")
    result = _result(label, passed, where, why)
    if not passed and why.startswith("tiny"):  # a rounding apart: the textbook's bias? (run
        # only here, on every rank alike: each decided from what all gathered)
        textbook = parallelized("textbook", textbook, lesson, init_device_mesh,
                                functools.partial(_bias_after_sum, lesson.RowwiseParallel))
        for mine, theirs in zip(everyone, _everyone(run("textbook", textbook))):
            mine["textbook"] = theirs
    if not passed and why.startswith("tiny") and compare(
            _runs(everyone, "yours"), _runs(everyone, "textbook"), world_size)[0]:
        result.update(passed=True, outcome="correct", diagnosis=(
            "correct, not stock's bits: bit for bit the textbook's row split, its bias added"
            " once after the sum, where stock adds each rank's share (bias / W) before it; the"
            " two round apart: add bias / world_size on each rank before the sum for stock's"
            " bits"))
    return result


def _in_tp_words(why, where, world_size, gathered=False):
    """compare()'s DDP words (an average skipped, a sum not divided) said as TP's mistakes;
    gathered: the block's input gathered by PrepareModuleInput before the column split."""
    value = ("(output)" if "(output)" in where else
             "(the input's gradient)" if "(the input's gradient)" in where else None)
    if "the average was skipped" in why:
        rank = why.split("'s gradients")[0]
        return {"(output)": f"{rank}'s output differs from rank 0's, where stock's is the same"
                            f" on every rank: the row split's partial outputs were not summed"
                            f" over the ranks (sum_over_ranks; scatter_sequence with sequence"
                            f" parallelism)",
                "(the input's gradient)": f"{rank}'s input gradient differs from rank 0's,"
                f" where stock's is the same on every rank: the column split's backward did"
                f" not sum the ranks' input gradients (copy_to_ranks; gather_sequence with"
                f" sequence parallelism)"}.get(value, f"{rank}'s gradients differ from rank"
                                               f" 0's, where stock's are the same on every"
                                               f" rank: a sum over the ranks is missing")
    factor = f"{world_size:.3f}x stock's"
    if world_size > 1 and why.startswith(factor) and "summed, not averaged" in why:
        if gathered:
            return (why.split(": summed, not averaged")[0] + ": the ranks' partial values"
                    " summed twice: the column split's input was gathered already, by"
                    " PrepareModuleInput (region.gave(name, x) is True), and that gather's"
                    " backward (a reduce_scatter) sums its gradient over the ranks;"
                    " copy_to_ranks sums it once more: return such an input as it is")
        return (why.split(": summed, not averaged")[0] + ": the ranks' partial values summed"
                " twice: one sum too many over the ranks (copy_to_ranks where"
                " gather_sequence's backward already sums, or a sum_over_ranks after"
                " scatter_sequence's reduce_scatter)")
    return why

