"""Measure what torch.compile does with each wrapper, in both orders, at 2 gloo ranks.

    python tests/scripts/compile_orders.py [--backend inductor|aot_eager]

For stock DDP, ManualDDP and BucketedDDP: wrapper(torch.compile(model)) and
torch.compile(wrapper(model)), 3 SGD steps on each rank's own batches. Prints per order:
graphs compiled, graph breaks, warnings raised, and the largest difference of the final
weights from stock DDP's in the same order and from stock DDP without compile.
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import run_ranks  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _one(rank, wrapper, order, backend):
    import torch._dynamo
    from minddp import BucketedDDP, ManualDDP
    cls = {"stock": DDP, "manual": ManualDDP, "bucketed": BucketedDDP, "eager": DDP}[wrapper]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base = _model()
        if wrapper == "eager":
            model = cls(base)
        elif order == "wrapper(compile(m))":
            model = cls(torch.compile(base, backend=backend))
        else:
            model = torch.compile(cls(base), backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    texts = sorted({str(w.message).splitlines()[0][:120] for w in caught})
    weights = [p.detach().clone() for p in base.parameters()]
    return graphs, breaks, texts, weights


def all_orders(rank, world_size, backend):
    results = {}
    for order in ("wrapper(compile(m))", "compile(wrapper(m))"):
        for wrapper in ("stock", "manual", "bucketed"):
            results[order, wrapper] = _one(rank, wrapper, order, backend)
    results["eager", "stock"] = _one(rank, "eager", None, backend)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    args = parser.parse_args()
    results = run_ranks(all_orders, 2, args.backend, timeout=900)[0]
    eager = results["eager", "stock"][3]
    print(f"torch {torch.__version__}, backend {args.backend}, 2 gloo ranks, rank 0's numbers")
    for (order, wrapper), (graphs, breaks, texts, weights) in results.items():
        if order == "eager":
            continue
        stock = results[order, "stock"][3]
        d_stock = max((a - b).abs().max().item() for a, b in zip(weights, stock))
        d_eager = max((a - b).abs().max().item() for a, b in zip(weights, eager))
        print(f"{order:22} {wrapper:9} graphs {graphs} breaks {breaks} warnings {len(texts)}"
              f" | vs stock same order {d_stock:.3g} | vs stock eager {d_eager:.3g}")
        for t in texts:
            print(f"{'':32}warning: {t}")


if __name__ == "__main__":
    main()
