"""What ZeRO-1 saves: optimizer-state bytes per rank, and what it costs in step time.

    minddp zero-bench                        # 1, 2 and 4 gloo ranks, started here
    minddp zero-bench --world-sizes 2 --sizes 4M

AdamW on the benchmark's MLPs (harness.py), ManualDDP averaging the gradients, three ways
to update the weights: the full optimizer on every rank, minddp's ShardedOptimizer and
PyTorch's ZeroRedundancyOptimizer. "state MB" counts the optimizer-state tensors this
rank holds (AdamW: two per parameter, plus a step count); "largest / mean" compares the
largest rank's state with the average, since whole parameters cannot be split evenly.
Step times are medians over rounds in a shuffled order, as ratios to the full optimizer.
"""

from . import bench_parser


def parse(argv=None):
    return bench_parser(__doc__, "minddp zero-bench", [1, 2, 4]).parse_args(argv)


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import copy  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402

from ..dropin.ddp import ManualDDP  # noqa: E402
from ..zero.optimizer import ShardedOptimizer  # noqa: E402
from . import SIZES  # noqa: E402
from .harness import collect_rows, mlp, print_table, time_steps, timed_rounds  # noqa: E402

WAYS = ["full AdamW", "ShardedOptimizer", "ZeroRedundancyOptimizer"]


def optimizer_for(way, params):
    kwargs = {"lr": 1e-3, "foreach": False}
    if way == "full AdamW":
        return torch.optim.AdamW(params, **kwargs)
    if way == "ShardedOptimizer":
        return ShardedOptimizer(params, torch.optim.AdamW, **kwargs)
    return ZeroRedundancyOptimizer(params, torch.optim.AdamW, **kwargs)


def state_bytes(optimizer):
    inner = getattr(optimizer, "optim", optimizer)  # the shard's optimizer, for the sharded two
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
               if torch.is_tensor(t))


def zero_size(size, args, rank, world_size, device):
    torch.manual_seed(0)
    base = mlp(*SIZES[size]).to(device)
    models = {w: ManualDDP(copy.deepcopy(base)) for w in WAYS}
    optimizers = {w: optimizer_for(w, models[w].parameters()) for w in WAYS}
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, SIZES[size][0], generator=g).to(device),
                torch.randint(0, 10, (args.batch,), generator=g).to(device))
               for _ in range(args.steps)]
    for w in WAYS:  # warm-up: the optimizer state is created at the first step
        time_steps(models[w], optimizers[w], batches[:1] * args.warmup, device, world_size)
    samples = timed_rounds({w: (models[w], optimizers[w]) for w in WAYS}, batches, args.rounds,
                           device, world_size)
    full = statistics.median(samples["full AdamW"])
    rows = []
    for w in WAYS:
        mine = torch.tensor([float(state_bytes(optimizers[w]))])
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        per_rank = [t.item() / 2**20 for t in everyone]
        median = statistics.median(samples[w])
        rows.append([world_size, size, w, f"{max(per_rank):.1f}",
                     f"{max(per_rank) / statistics.mean(per_rank):.2f}", f"{sum(per_rank):.1f}",
                     f"{median * 1e3:.2f}", f"{median / full:.2f}x"])
    return rows


HEADERS = ["ranks", "model", "optimizer", "state MB (largest rank)", "largest / mean",
           "state MB (all ranks)", "median ms/step", "vs full"]


def main(args):
    rows = collect_rows(args, zero_size)
    if rows is not None:
        print_table(args, rows, HEADERS, what="optimizer")


if __name__ == "__main__":
    main(ARGS)
