"""Benchmark: step time of no sync, naive and bucketed DDP, and stock DDP, side by side.

    minddp bench                                      # 1 and 2 gloo ranks, started here
    minddp bench --world-sizes 2 --sizes 0.3M 4M      # a subset
    torchrun --nproc_per_node=2 -m minddp.bench.ddp   # under torchrun: its world size
    minddp bench --device cuda --backend nccl --world-sizes 1

The contenders run in one job, one step each per round, in a shuffled order (harness.py).
Each contender's figure is the median over its timed steps, reported as a ratio to stock
DDP's median: below 1.00x is faster; "view" and "fp16" rows also as a ratio to stock with
the same setting ("view": gradient_as_bucket_view=True; "fp16": a comm hook that sends
float16, dropin/comm_hooks.py). "bucketed" is ManualDDP, BucketedDDP with stock's knobs.
"per round" pairs each step with stock's step of the same round (the machine's pace then is
the same for both): the median of those ratios, and the middle half of them (q1-q3), so a
difference smaller than the noise shows as a range that holds 1.00x.

    git clone https://github.com/huggingface/picotron /tmp/picotron
    minddp bench --world-sizes 2 --picotron /tmp/picotron   # picotron's DataParallelBucket too
"""

from . import bench_parser

CONTENDERS = ["no sync", "naive", "bucketed", "stock", "bucketed view", "stock view",
              "bucketed fp16", "stock fp16"]


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp bench", [1, 2])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS,
                        help="view: gradient_as_bucket_view=True; fp16: dropin's fp16_mean_hook")
    parser.add_argument("--picotron", metavar="PATH",
                        help="a clone of huggingface/picotron: its DataParallelBucket runs as"
                             " one more contender, \"picotron\" (nothing of it is copied here)")
    args = parser.parse_args(argv)
    if args.picotron:
        import os
        if not os.path.isfile(os.path.join(args.picotron, "picotron", "data_parallel",
                                           "data_parallel.py")):
            parser.exit(2, f"error: --picotron {args.picotron}: no picotron/data_parallel/"
                           "data_parallel.py there\n---> HINT: git clone"
                           " https://github.com/huggingface/picotron PATH, then --picotron PATH\n")
        args.contenders = args.contenders + ["picotron"]
    return args


if __name__ == "__main__":
    ARGS = parse()  # before torch loads (seconds on a busy machine): a typo costs a moment


import copy  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from ..dropin.comm_hooks import fp16_mean_hook  # noqa: E402
from ..dropin.ddp import ManualDDP  # noqa: E402
from ..ddp.naive import NaiveDDP  # noqa: E402
from . import SIZES  # noqa: E402
from .harness import (collect_rows, mlp, per_round, print_table, time_steps,  # noqa: E402
                      timed_rounds)

def wrap(contender, module, device):
    """The contender's model. "view": gradient_as_bucket_view=True; "fp16": fp16_mean_hook."""
    if contender == "no sync":
        return module  # each rank trains alone: the compute-only floor
    if contender == "naive":
        return NaiveDDP(module)
    if contender == "picotron":
        return picotron_bucket(module)
    view = contender.endswith(" view")
    if contender.startswith("bucketed"):
        model = ManualDDP(module, gradient_as_bucket_view=view)
    else:
        model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=view)
    if contender.endswith(" fp16"):
        model.register_comm_hook(None, fp16_mean_hook)
    return model


def picotron_bucket(module):
    """picotron's DataParallelBucket (a Python peer of ManualDDP), from the clone --picotron
    names: one data-parallel group over every rank, its default 25 MB buckets."""
    import picotron.process_group_manager as pgm
    from picotron.data_parallel.data_parallel import DataParallelBucket
    if getattr(pgm, "process_group_manager", None) is None:
        pgm.setup_process_group_manager(1, 1, 1, dist.get_world_size())  # tp, cp, pp, dp
    return DataParallelBucket(module)


def grad_memory_mb(contender, model):
    """MB held by .grad tensors and gradient buckets together, after a step (distinct storages)."""
    storages = {}
    for p in model.parameters():
        if p.grad is not None:
            s = p.grad.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    if contender.startswith("bucketed"):
        for b in model.buckets:
            s = b.flat.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    elif contender.startswith("stock") and not contender.endswith(" view"):
        # Stock's buckets live in C++; the reducer hands out zero tensors of their shapes.
        for i, b in enumerate(model.reducer._get_zeros_like_grad_buckets()):
            storages[("stock bucket", i)] = b.buffer().numel() * b.buffer().element_size()
    return sum(storages.values()) / 2**20


def all_reduce_calls(contender, model, world_size):
    if world_size == 1 or contender == "no sync":
        return 0
    if contender == "naive":
        return sum(p.requires_grad for p in model.parameters())
    if contender.startswith("bucketed"):
        return len(model.buckets)
    if contender == "picotron":
        return len(model.bucket_manager.buckets)
    # Stock's reducer keeps its buckets in C++; its layout equals ManualDDP's bucketed
    # one (tests/test_buckets.py checks it through a comm hook), so its count is the same.
    return None


def bench_size(size, args, rank, world_size, device):
    width, layers = SIZES[size]
    if args.picotron and args.picotron not in sys.path:
        sys.path.insert(0, args.picotron)
    torch.manual_seed(0)
    base = mlp(width, layers).to(device)
    contenders = args.contenders
    models = {c: wrap(c, copy.deepcopy(base), device) for c in contenders}  # same start for all
    optimizers = {c: torch.optim.SGD(m.parameters(), lr=1e-3) for c, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, width, generator=g).to(device),
                torch.randint(0, 10, (args.batch,), generator=g).to(device))
               for _ in range(args.steps)]
    for c in contenders:  # warm-up: allocations, and the buckets' rebuild after step one
        time_steps(models[c], optimizers[c], batches[:args.warmup], device, world_size)
    samples = timed_rounds({c: (models[c], optimizers[c]) for c in contenders}, batches,
                           args.rounds, device, world_size)
    params = sum(p.numel() for p in base.parameters())
    grad_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
    stock = statistics.median(samples["stock"])
    rows = []
    for c in contenders:
        median = statistics.median(samples[c])
        synced = world_size > 1 and c != "no sync"
        sent = grad_mb / 2 if c.endswith(" fp16") else grad_mb  # float16 on the wire
        calls = all_reduce_calls(c, models[c], world_size)
        knob = c.split(" ", 1)[1] if c.startswith(("bucketed ", "stock ")) else None
        twin = f"stock {knob}" if knob else None  # stock DDP with the same setting
        same = f"{median / statistics.median(samples[twin]):.2f}x" if twin in samples else ""
        rows.append([world_size, size, f"{params / 1e6:.2f}M", c, f"{median * 1e3:.2f}",
                     f"{median / stock:.2f}x", per_round(samples[c], samples["stock"]),
                     same, f"{sent if synced else 0:.1f}",
                     "=bucketed" if calls is None else calls,
                     f"{grad_memory_mb(c, models[c]):.1f}"])
    return rows


HEADERS = ["ranks", "model", "params", "contender", "median ms/step", "vs stock",
           "vs stock per round (q1-q3)", "vs stock, same knob",
           "MB all-reduced/step", "all_reduce calls/step", "MB grads+buckets"]


def main(args):
    rows = collect_rows(args, bench_size)
    if rows is not None:
        print_table(args, rows, HEADERS)


if __name__ == "__main__":
    main(ARGS)
