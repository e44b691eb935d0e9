"""What the ordered reduction costs: step time and bytes, beside stock DDP's all_reduce.

    minddp elastic-bench                      # 2 and 4 gloo ranks, started here
    minddp elastic-bench --world-sizes 2 --sizes 4M --virtual-shards 12

One global batch of --global-batch rows per step on the benchmark's MLPs (harness.py), SGD,
three ways: stock DDP (one all_reduce per bucket, overlapped with backward), minddp's
BucketedDDP (the same), and elastic/resize.py's ordered reduction (each of N virtual shards'
gradient computed alone, then a chain that adds them in shard order, then a broadcast).
"MB sent" counts the bytes this rank passes to send/broadcast/all_reduce per step (rank 0's
figure; stock's, all_reduced from C++, is its gradients' bytes: each enters one all_reduce);
times are medians over rounds in a shuffled order, the slowest rank's, as ratios to stock's.
"""

from . import bench_parser


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp elastic-bench", [2, 4])
    parser.add_argument("--global-batch", type=int, default=96,
                        help="rows per step over all ranks (every world size must divide it)")
    parser.add_argument("--virtual-shards", type=int, default=12,
                        help="the ordered reduction's shards (divides --global-batch)")
    parser.set_defaults(sizes=["0.3M", "4M"], rounds=20)
    args = parser.parse_args(argv)
    args.batch = args.global_batch  # (what the table's first line reports as the batch)
    return args


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import copy  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from ..ddp.bucketed import BucketedDDP  # noqa: E402
from ..elastic.resize import (check_world, ordered_average, set_gradients,  # noqa: E402
                              shard_gradients)
from . import SIZES  # noqa: E402
from .harness import collect_rows, mlp, print_table  # noqa: E402

WAYS = ["stock DDP", "BucketedDDP", "ordered"]
SENT = ("send", "broadcast", "all_reduce")


def step_for(way, model, optimizer, shards):
    """One training step of `way` on a batch: zero_grad, gradients averaged, optimizer.step()."""
    def step(x, y):
        optimizer.zero_grad()
        if way == "ordered":
            rows, _ = shard_gradients(model, F.cross_entropy, x, y, shards)
            set_gradients(model, ordered_average(rows, shards * dist.get_world_size()))
        else:
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def bytes_sent(step, x, y):
    """Bytes this rank passes to send, broadcast and all_reduce in one step."""
    counted, originals = [0], {name: getattr(dist, name) for name in SENT}

    def counting(original):
        def call(tensor, *args, **kwargs):
            counted[0] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        return call
    for name in SENT:
        setattr(dist, name, counting(originals[name]))
    try:
        step(x, y)
    finally:
        for name in SENT:
            setattr(dist, name, originals[name])
    return counted[0]


def elastic_size(size, args, rank, world_size, device):
    check_world(args.global_batch, world_size, args.virtual_shards)
    torch.manual_seed(0)
    base = mlp(*SIZES[size]).to(device)
    models = {"stock DDP": DDP(copy.deepcopy(base)),
              "BucketedDDP": BucketedDDP(copy.deepcopy(base)), "ordered": copy.deepcopy(base)}
    steps = {w: step_for(w, models[w], torch.optim.SGD(models[w].parameters(), lr=1e-3),
                         args.virtual_shards // world_size) for w in WAYS}
    g = torch.Generator().manual_seed(rank)
    rows_here = args.global_batch // world_size
    x = torch.randn(rows_here, SIZES[size][0], generator=g).to(device)
    y = torch.randint(0, 10, (rows_here,), generator=g).to(device)
    for w in WAYS:
        for _ in range(args.warmup):
            steps[w](x, y)
    sent = {w: bytes_sent(steps[w], x, y) for w in WAYS}
    # Stock's reducer calls all_reduce from C++, out of the counter's reach; it reduces every
    # gradient once, in its buckets: the gradients' bytes.
    sent["stock DDP"] = sum(p.numel() * p.element_size() for p in base.parameters())
    samples = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for w in random.Random(r).sample(WAYS, len(WAYS)):
            dist.barrier()  # start together: a rank's early finish must not land on the next way
            t0 = time.perf_counter()
            steps[w](x, y)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            samples[w].append(took.item())
    stock = statistics.median(samples["stock DDP"])
    return [[world_size, size, w, f"{sent[w] / 2**20:.2f}", f"{sent[w] / sent['stock DDP']:.2f}x",
             f"{statistics.median(samples[w]) * 1e3:.2f}",
             f"{statistics.median(samples[w]) / stock:.2f}x"] for w in WAYS]


HEADERS = ["ranks", "model", "reduction", "MB sent (rank 0)", "vs stock", "median ms/step",
           "vs stock"]


def main(args):
    from ..run.errors import exit_on_usage_error
    with exit_on_usage_error():  # before any rank starts: one line, exit 2
        for world_size in args.world_sizes:
            check_world(args.global_batch, world_size, args.virtual_shards)
    rows = collect_rows(args, elastic_size)
    if rows is not None:
        print_table(args, rows, HEADERS,
                    what=f"way; global batch {args.global_batch}, {args.virtual_shards} shards")


if __name__ == "__main__":
    main(ARGS)
