"""A zoo of real model shapes, ManualDDP against stock DDP, bit for bit.

    pytest tests/test_zoo.py

Small versions of models people train, 3 SGD steps at 2 and 3 gloo ranks, each rank its
own batches; compared on every rank: every gradient after every step (sparse ones too),
the state_dict (buffers included) and the eval-mode output.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import share_spawn, shared_results
from minddp import BucketedDDP, ManualDDP, NaiveDDP, UsageError


class TinyLM(torch.nn.Module):
    """Embedding, learned positions, one encoder layer, LayerNorm, output tied to the embedding."""

    def __init__(self, vocab=50, width=16, length=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.block = torch.nn.TransformerEncoderLayer(width, 2, 32, dropout=0.1, batch_first=True)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.head(self.norm(self.block(self.embed(tokens) + self.positions)))

    @staticmethod
    def batch(g):
        tokens = torch.randint(0, 50, (4, 8), generator=g)
        return tokens, lambda out: F.cross_entropy(out.reshape(-1, 50), tokens.roll(-1, 1).reshape(-1))


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Dropout(0.2), torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.layers(x)

    @staticmethod
    def batch(g):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        return x, lambda out: F.cross_entropy(out, y)


class Mixed(torch.nn.Module):
    """A float64 part and a float32 part: buckets are kept apart by dtype."""

    def __init__(self):
        super().__init__()
        self.front = torch.nn.Linear(4, 8).double()
        self.back = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.back(torch.tanh(self.front(x.double())).float())

    @staticmethod
    def batch(g):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        return x, lambda out: F.cross_entropy(out, y)


class SparseBag(torch.nn.Module):
    """An embedding-bag model with sparse gradients: each such parameter travels alone."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(40, 8, mode="mean", sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.bag(ids))

    @staticmethod
    def batch(g):
        ids, y = torch.randint(0, 40, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)
        return ids, lambda out: F.cross_entropy(out, y)


class Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(4, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.frozen(x)))

    @staticmethod
    def batch(g):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        return x, lambda out: F.cross_entropy(out, y)


ZOO = {"tiny-lm": TinyLM, "convnet": ConvNet, "mixed-dtypes": Mixed, "sparse-bag": SparseBag,
       "frozen": Frozen}


def _grad(p):
    if p.grad is None:
        return None
    return p.grad.coalesce() if p.grad.is_sparse else p.grad.clone()


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.is_sparse != b.is_sparse:
        return False
    if a.is_sparse:
        return torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
    return torch.equal(a, b)


def _train(model, rank, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        inputs, loss_of = model.module.batch(torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        torch.manual_seed(1000 * step + rank)  # the same dropout masks for both wrappers
        loss_of(model(inputs)).backward()
        grads.append([_grad(p) for p in model.module.parameters()])
        optimizer.step()
    model.eval()
    inputs, _ = model.module.batch(torch.Generator().manual_seed(999))
    with torch.no_grad():
        return grads, copy.deepcopy(model.module.state_dict()), model(inputs)


def _zoo(rank, world_size, names, wrappers):
    problems = []
    for name in names:
        torch.manual_seed(rank)  # different weights per rank: the wrappers broadcast rank 0's
        base = ZOO[name]()
        stock = _train(DDP(copy.deepcopy(base)), rank)
        for wrapper in wrappers:
            mine = _train(wrapper(copy.deepcopy(base)), rank)
            for step, (a, b) in enumerate(zip(stock[0], mine[0])):
                bad = [i for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)]
                if bad:
                    problems.append(f"{name} {wrapper.__name__}: step {step} parameters {bad}")
            bad = [k for k in stock[1] if not torch.equal(stock[1][k], mine[1][k])]
            if bad or not torch.equal(stock[2], mine[2]):
                problems.append(f"{name} {wrapper.__name__}: state {bad} / eval output")
    return problems


share_spawn(_zoo, [2, 3], list(ZOO), [ManualDDP], key="zoo")  # in the suite's shared spawns
share_spawn(_zoo, [1, 2, 3], ["sparse-bag"], [ManualDDP], key="sparse")


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_zoo_is_bitwise_equal_to_stock(world_size):
    for problems in shared_results(_zoo, world_size, key="zoo"):
        assert problems == []


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sparse_gradients_equal_stocks(world_size):
    # ManualDDP sends the sparse gradient alone, as stock does: everything bitwise.
    for problems in shared_results(_zoo, world_size, key="sparse"):
        assert problems == []


class SparseParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.eye(3).to_sparse())


def _wrap_sparse_parameter(rank, world_size):
    messages = []
    try:
        ManualDDP(SparseParameter())
    except UsageError as err:
        messages.append(str(err))
    for lecture in (BucketedDDP, NaiveDDP):  # the lecture classes keep to dense gradients
        model = lecture(SparseBag())
        inputs, loss_of = SparseBag.batch(torch.Generator().manual_seed(0))
        try:
            loss_of(model(inputs)).backward()
        except UsageError as err:
            messages.append(str(err))
    return messages


share_spawn(_wrap_sparse_parameter, [1])


def test_a_layout_buckets_cannot_hold_is_named():
    wrap, sparse_grad, naive = shared_results(_wrap_sparse_parameter, 1)[0]
    assert naive.startswith("a sparse gradient (nn.Embedding(sparse=True)): NaiveDDP averages"
                            " dense ones (hint: ManualDDP sends")
    assert wrap.startswith("parameter 'table' is a torch.sparse_coo tensor: ManualDDP's buckets"
                           " hold dense (strided) parameters")
    assert sparse_grad.startswith("'bag.weight' has a sparse gradient (hint: ManualDDP sends")
