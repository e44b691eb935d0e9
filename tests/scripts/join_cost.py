"""What join() costs: step time with and without it, even data, 2 gloo ranks, both wrappers.

    python tests/scripts/join_cost.py [--steps 200]

Inside join() every step adds the collectives of minddp/join.py (an all_reduce saying "still
here", one saying whether this step syncs; for a model with buffers, an all_reduce MAX and
the buffers' broadcasts from the agreed rank). Printed: the median step time of each way, as
a ratio to the same wrapper without join(), and the shadowed step on a joined rank.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import run_ranks  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _time(rank, wrapper, join, steps):
    from minddp import ManualDDP
    model = {"stock": DDP, "manual": ManualDDP}[wrapper](_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    times, shadowed = [], []
    # join: rank 1 has `steps` extra steps, which rank 0 shadows once it has joined.
    own = steps + (steps if join and rank == 1 else 0)
    with model.join() if join else torch.enable_grad():
        for _ in range(own):
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
    if join and rank == 0:
        shadowed.append((time.perf_counter() - start) / steps)  # rank 0's wait = its shadowing
    return statistics.median(times[5:steps]), shadowed


def _all(rank, world_size, steps):
    return {(w, j): _time(rank, w, j, steps) for w in ("stock", "manual") for j in (False, True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = run_ranks(_all, 2, args.steps, timeout=900)
    print(f"torch {torch.__version__}, 2 gloo ranks, Linear-BatchNorm MLP, {args.steps} steps")
    for wrapper in ("stock", "manual"):
        plain, joined = results[0][wrapper, False][0], results[0][wrapper, True][0]
        shadow = results[0][wrapper, True][1][0]
        print(f"{wrapper:7} step {plain * 1e3:.2f} ms, inside join() {joined * 1e3:.2f} ms"
              f" ({joined / plain:.2f}x); a shadowed step on the joined rank {shadow * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
