"""What every check shares: the models, the batches, and one training run recorded.

    minddp grade exercises/naive.py      # ranks/world.py runs checks.CHECKS[exercise] on every rank

Every check (checks/) runs on each rank (a collective), gathers what every rank saw, and
returns the same results on each: [{"check", "passed", "where", "diagnosis"}]. The models
start from each rank's own seed, so that a missing broadcast shows; every rank trains on its
own batch.
"""

import contextlib
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...run.toy import NeuralNetwork
from ..judge.bound import local_gradients

STEPS = 3
# The collectives whose calls are counted (and, by ranks/world.py, logged); isend and irecv stay
# unwrapped: P2POp checks that its op IS dist.isend or dist.irecv.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_to_all_single", "barrier", "send", "recv", "batch_isend_irecv",
               "all_gather_object", "gather_object")


def _np(t):
    return None if t is None else t.detach().cpu().numpy().copy()


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _everyone(record):
    """[every rank's record] on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return gathered


def destroy(group):
    """Destroy a check's own process group once nothing of the check holds it. Call it
    after the wrappers that used the group are gone: a stock DDP caught in a reference cycle
    is freed here, not later, when its C++ reducer would drop the destroyed group's last
    reference on the main thread, GIL held (launch/teardown.py: a hang, or worse)."""
    gc.collect()
    dist.destroy_process_group(group)


def _runs(everyone, who):
    """One implementation's run over all ranks, as diagnosis.compare() reads it."""
    return {"start": [e[who]["start"] for e in everyone],
            "grads": [[e[who]["grads"][s] for e in everyone] for s in range(STEPS)],
            "weights": [[e[who]["weights"][s] for e in everyone] for s in range(STEPS)]}


def _result(check, passed, where="", diagnosis=""):
    """A check's result; one that passes with a diagnosis "correct, ..." is `correct`: right
    within a stated rounding bound (judge/bound.py), not stock's bits."""
    result = {"check": check, "passed": passed, "where": where, "diagnosis": diagnosis}
    if passed and diagnosis.startswith("correct"):
        result["outcome"] = "correct"
    return result


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
    `plain` copy of the model: each step's local gradients too (judge/bound.py), from the
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
