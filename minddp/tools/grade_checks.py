"""The grader's checks: each exercise's student code and stock's, on the same models and data.

    minddp grade exercises/naive.py      # grade.py runs CHECKS[exercise] on every rank

Every check runs on each rank (a collective), gathers what every rank saw, and returns the
same results on each: [{"check", "passed", "where", "diagnosis"}]. The models start from
each rank's own seed, so that a missing broadcast shows; every rank trains on its own batch.
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
# Stock's references, imported before any process group exists: importing
# torch.distributed.optim after init_process_group keeps the group alive past its destroy.
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.distributed.tensor import parallel as stock_tp
from torch.nn.parallel import DistributedDataParallel

from ..run.toy import NeuralNetwork
from .diagnosis import compare
from .grade_bound import local_gradients

STEPS = 3


def _np(t):
    return None if t is None else t.detach().cpu().numpy().copy()


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _everyone(record):
    """[every rank's record] on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return gathered


def _runs(everyone, who):
    """One implementation's run over all ranks, as diagnosis.compare() reads it."""
    return {"start": [e[who]["start"] for e in everyone],
            "grads": [[e[who]["grads"][s] for e in everyone] for s in range(STEPS)],
            "weights": [[e[who]["weights"][s] for e in everyone] for s in range(STEPS)]}


def _result(check, passed, where="", diagnosis=""):
    return {"check": check, "passed": passed, "where": where, "diagnosis": diagnosis}


def _ranks(world_size):
    return f"{world_size} rank{'s' if world_size > 1 else ''}"


def toy_batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 2, generator=g), torch.randint(0, 2, (4,), generator=g)


def gpt_batch(rank, step):
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(
        100 * step + rank))
    return tokens[:, :-1], tokens[:, 1:]


class TiedLM(torch.nn.Module):
    """A small language model: its output layer is its embedding (one tensor), and a frozen
    LayerNorm (no gradient, no hook)."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.wte, self.ln = torch.nn.Embedding(vocab, d), torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))
        self.ln.requires_grad_(False)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.mlp(self.ln(x))
        return x @ self.wte.weight.T  # tied: the embedding's weight, used twice


def next_token(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


MODELS = [  # (label, build, the optimizer's name, optimizer, batch, loss)
    ("the toy model", lambda: NeuralNetwork(num_inputs=2, num_outputs=2), "SGD",
     lambda ps: torch.optim.SGD(ps, lr=0.5), toy_batch, F.cross_entropy),
    ("an LM with a tied embedding and a frozen layer", TiedLM, "AdamW",
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False), gpt_batch, next_token),
]


@contextlib.contextmanager
def _counting(counts):
    """{collective: calls} made through torch.distributed's Python functions meanwhile."""
    from .grade_run import COLLECTIVES
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(name, original):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)
        return call
    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _train(wrapped, module, make_optimizer, batch, loss_fn, rank, plain=None, micro=False):
    """STEPS steps: the weights before, each step's gradients and weights after. With a
    `plain` copy of the model: each step's local gradients too (grade_bound.py), from the
    weights the step starts with. micro: step 1 in two halves, the first under no_sync()."""
    record = {"start": {n: _np(_whole(p)) for n, p in module.named_parameters()},
              "grads": [], "weights": [], "local": []}
    optimizer = make_optimizer(wrapped.parameters())
    for step in range(STEPS):
        x, y = batch(rank, step)
        halves = [(x[:len(x) // 2], y[:len(y) // 2]), (x[len(x) // 2:], y[len(y) // 2:])] \
            if micro and step == 1 else [(x, y)]
        if plain is not None:
            record["local"].append(local_gradients(plain, module, halves, loss_fn))
        optimizer.zero_grad()
        for i, (xs, ys) in enumerate(halves):
            if i < len(halves) - 1:  # the collectives a no_sync() backward calls: none
                with wrapped.no_sync(), _counting(record.setdefault("in no_sync", {})):
                    loss_fn(wrapped(xs), ys).backward()
            else:
                loss_fn(wrapped(xs), ys).backward()
        record["grads"].append({n: _np(None if p.grad is None else _whole(p.grad))
                                for n, p in module.named_parameters()})
        optimizer.step()
        record["weights"].append({n: _np(_whole(p)) for n, p in module.named_parameters()})
    return record


class _MLP(torch.nn.Module):
    """A replicated layer, then the column split (up) and the row split (down)."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = torch.nn.Linear(d, 4 * d)
        self.up, self.down = torch.nn.Linear(4 * d, 8 * d), torch.nn.Linear(8 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(torch.tanh(self.embed(x)))))


def tp(student, rank, world_size):
    """The student's column and row splits against stock's parallelize_module: the output,
    the input's gradient, every whole gradient and weight, every step."""
    from ..mesh import init_device_mesh
    from ..tp_plan import sliced
    torch.manual_seed(0)
    model = _MLP()
    stock = copy.deepcopy(model)
    student.parallelize_module(model, init_device_mesh("cpu", (world_size,)),
                               {"up": student.ColwiseParallel(), "down": student.RowwiseParallel()})
    stock_tp.parallelize_module(stock, stock_mesh("cpu", (world_size,)),
                                {"up": stock_tp.ColwiseParallel(),
                                 "down": stock_tp.RowwiseParallel()})
    cuts = sliced(model)  # the student's slices: (dim, group) per parameter name

    def whole(name, t, mine):
        if t is None or not mine or name not in cuts:
            return _np(_whole(t))
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.detach().contiguous(), group=cuts[name][1])
        return _np(torch.cat(parts, cuts[name][0]))
    record = {}
    for who, m in (("stock", stock), ("yours", model)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        mine = who == "yours"
        record[who] = {"start": {n: whole(n, p, mine) for n, p in m.named_parameters()},
                       "grads": [], "weights": []}
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))  # the same
            x.requires_grad_()  # on every rank: TP splits the layers, not the batch
            optimizer.zero_grad()
            out = m(x)
            out.square().mean().backward()
            grads = {n: whole(n, p.grad, mine) for n, p in m.named_parameters()}
            record[who]["grads"].append({"(output)": _np(out), "(the input's gradient)":
                                         _np(x.grad), **grads})
            optimizer.step()
            record[who]["weights"].append({n: whole(n, p, mine) for n, p in m.named_parameters()})
    everyone = _everyone(record)
    passed, where, why = compare(_runs(everyone, "yours"), _runs(everyone, "stock"), world_size,
                                 "stock adds each rank's share of the row split's bias before"
                                 " the sum")
    if "(output)" in where:  # by how much: the row split's bias, once per rank too many?
        extra = everyone[0]["yours"]["grads"][0]["(output)"] - everyone[0]["stock"]["grads"][0][
            "(output)"]
        bias = everyone[0]["stock"]["start"]["down.bias"]
        if world_size > 1 and abs(extra - (world_size - 1) * bias).max() < 1e-5:
            why = (f"the output holds the row split's bias {world_size} times: every rank adds"
                   f" all of it before the sum (add bias / world_size on each, as stock)")
    return [_result(f"{_ranks(world_size)}, a replicated layer, then up (column) and down"
                    f" (row), AdamW", passed, where, why)]


def _all_checks():
    from . import grade_ddp, grade_pieces, grade_sharded
    return {"tp": tp, **grade_ddp.CHECKS, **grade_sharded.CHECKS, **grade_pieces.CHECKS}


CHECKS = {}  # exercise -> check(student, rank, world_size): filled below, from every file
CHECKS.update(_all_checks())
