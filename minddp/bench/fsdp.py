"""What each ZeRO stage keeps per rank, what it sends, and its step time beside stock fully_shard.

    minddp fsdp-bench                          # 1, 2 and 4 gloo ranks, started here
    minddp fsdp-bench --world-sizes 2 --sizes 4M --rounds 10
    minddp fsdp-bench --sizes 4M --png runs/zero-memory.png   # the picture

AdamW on the benchmark's MLPs (harness.py), eight ways: DDP (ManualDDP), ZeRO-1 (ManualDDP with
ShardedOptimizer), FSDP with reshard_after_forward=False (weights kept from forward to
backward: ZeRO-2-like) and True (ZeRO-3), each as the lesson's fully_shard and stock's, and
ZeRO-3 with explicit prefetching (each layer gathers the next one's weights in forward, the
previous one's in backward) as minddp.fully_shard (on its prefetch thread) and stock's; every
Linear layer is a unit. Per rank, the largest over ranks, in MB:

  params      parameter tensors held between steps (whole, or this rank's shards)
  grads       .grad tensors after backward (DDP's all-reduce buckets not counted)
  optimizer   AdamW's state (two tensors per parameter, and a step count)
  unsharded   the peak of whole weights gathered at once, sampled after every gather
              (the all-gather's own flat buffer, freed at once, is not counted)

"sent / P" is what one rank sends per step under the ring model, in units of P (W-1)/W, P
the model's bytes: an all_reduce of n bytes sends 2n (W-1)/W, an all_gather (output n), a
reduce_scatter (input n) and a broadcast n (W-1)/W each; the sizes are those passed to the
collectives, counted. Step times: medians over rounds in a shuffled order, as ratios to
stock fully_shard (ZeRO-3) in the same run.
"""

from . import bench_parser, check_outputs


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp fsdp-bench", [1, 2, 4])
    parser.add_argument("--json", metavar="PATH", help="also write the rows, unrounded, to PATH")
    parser.add_argument("--png", metavar="PATH",
                        help="draw the bytes per rank as stacked bars (matplotlib; the last"
                             " --sizes model's rows)")
    return check_outputs(parser.parse_args(argv), "json", "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import contextlib  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard as stock_fully_shard  # noqa: E402

from ..dropin.ddp import ManualDDP  # noqa: E402
from ..dropin import fsdp_prefetch  # noqa: E402
from ..dropin.fsdp import fully_shard as dropin_fully_shard  # noqa: E402
from ..fsdp.shard import Unit, fully_shard, unit_of  # noqa: E402
from ..tools.pictures import draw_memory  # noqa: E402
from ..zero.optimizer import ShardedOptimizer  # noqa: E402
from . import SIZES, stock_fsdp  # noqa: E402
from .harness import (RING, collect_rows, counting_collectives, machine, mlp,  # noqa: E402
                      print_table, time_steps, timed_rounds)

WAYS = ["DDP", "ZeRO-1", "FSDP no reshard", "stock no reshard", "FSDP", "stock fully_shard",
        "FSDP prefetch", "stock prefetch"]



def build(way, base):
    model = copy.deepcopy(base)
    kwargs = {"lr": 1e-3, "foreach": False}
    if way in ("DDP", "ZeRO-1"):
        model = ManualDDP(model)
        if way == "ZeRO-1":
            return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, **kwargs)
        return model, torch.optim.AdamW(model.parameters(), **kwargs)
    shard = {"FSDP": fully_shard, "FSDP no reshard": fully_shard,
             "FSDP prefetch": dropin_fully_shard}.get(way, stock_fully_shard)
    layers = [layer for layer in model if isinstance(layer, torch.nn.Linear)]
    for layer in layers:
        shard(layer, reshard_after_forward="no reshard" not in way)
    shard(model)
    if way.endswith("prefetch"):  # each layer gathers the next in forward, the one before in
        for i, layer in enumerate(layers):  # backward, while it computes
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0):i])
    return model, torch.optim.AdamW(model.parameters(), **kwargs)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # stock's DTensors: this rank's part


def held_mb(model, optimizer):
    inner = getattr(optimizer, "optim", optimizer)  # ShardedOptimizer: this rank's optimizer
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    state = [_local(t) for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    return [sum(t.numel() * t.element_size() for t in ts) / 2**20 for ts in (params, grads, state)]


class Peak:
    """The most bytes of whole (gathered) weights alive at once, sampled after every gather."""

    def __init__(self):
        self.tensors, self.bytes = [], 0

    def sample(self):
        self.bytes = max(self.bytes, sum(t.untyped_storage().nbytes() for t in self.tensors))


@contextlib.contextmanager
def sampling_after_gathers(peak):
    """Both fully_shards, patched for the run: sample `peak` right after each unshard."""
    stock_class, stock_method = stock_fsdp.unshard_done_method()
    originals = {(Unit, "unshard"): Unit.unshard,
                 (stock_class, stock_method): getattr(stock_class, stock_method)}

    def sampled(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            peak.sample()
            return result
        return call
    for (cls, name), original in originals.items():
        setattr(cls, name, sampled(original))
    try:
        yield
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, original)


def whole_weights(way, model):
    """The tensors a way computes with: DDP's parameters, or each FSDP's whole weights."""
    if way in ("DDP", "ZeRO-1"):
        return list(model.parameters())
    if way.startswith("FSDP"):
        return [p.full for m in model.modules() if unit_of(m) is not None
                for p in unit_of(m).params]
    return stock_fsdp.whole_weights(model)


def fsdp_size(size, args, rank, world_size, device):
    torch.manual_seed(0)
    base = mlp(*SIZES[size]).to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    built = {w: build(w, base) for w in WAYS}
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, SIZES[size][0], generator=g).to(device),
                torch.randint(0, 10, (args.batch,), generator=g).to(device))
               for _ in range(args.steps)]
    memory, sent = {}, {}
    for w in WAYS:  # one measured step each (the optimizer state exists after it)
        peak, counts = Peak(), {}
        # Two steps first: stock gathers lazily, DDP rebuilds its buckets once.
        time_steps(*built[w], batches[:1] * 2, device, world_size)
        peak.tensors = whole_weights(w, built[w][0])
        with sampling_after_gathers(peak), counting_collectives(counts):
            time_steps(*built[w], batches[:1], device, world_size)
        if w in ("DDP", "ZeRO-1"):
            peak.sample()  # whole all the time
        memory[w] = held_mb(*built[w]) + [peak.bytes / 2**20]
        sent[w] = (sum(RING[n] * b for n, b in counts.items()) / model_bytes, counts)
    for w in WAYS:
        time_steps(*built[w], batches[:1] * args.warmup, device, world_size)
    fsdp_prefetch.seconds.update(gathering=0.0, waited=0.0)
    samples = timed_rounds(built, batches, args.rounds, device, world_size)
    steps = args.rounds * len(batches)  # (only "FSDP prefetch" uses the prefetch thread)
    prefetch_ms = [fsdp_prefetch.seconds[k] * 1e3 / steps for k in ("gathering", "waited")]
    stock = statistics.median(samples["stock fully_shard"])
    rows = []
    for w in WAYS:
        mine = torch.tensor(memory[w])
        everyone = [torch.zeros(4) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        largest = torch.stack(everyone).max(dim=0).values.tolist()
        ratio, counts = sent[w]
        median = statistics.median(samples[w])
        rows.append({"ranks": world_size, "model": size, "way": w, "params": largest[0],
                     "grads": largest[1], "optimizer": largest[2], "unsharded": largest[3],
                     "model MB": model_bytes / 2**20, "sent / P": ratio,
                     "passed MB": {_short(n): b / 2**20 for n, b in counts.items() if b},
                     "ms": median * 1e3, "vs stock": median / stock})
        if w == "FSDP prefetch":  # rank 0's: ms per step gathering on the thread, waited for
            rows[-1]["prefetch ms"] = prefetch_ms
    return rows


def _short(name):  # all_gather_single, all_gather_into_tensor -> all_gather
    return name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")


HEADERS = ["ranks", "model", "way", "params MB", "grads MB", "optimizer MB", "unsharded MB",
           "held MB (p+g+o)", "sent / P", "collectives (MB passed)", "median ms/step",
           "vs stock fully_shard"]


def table_row(r):
    held = r["params"] + r["grads"] + r["optimizer"]
    return [r["ranks"], r["model"], r["way"], *(f"{r[k]:.1f}" for k in
                                                ("params", "grads", "optimizer", "unsharded")),
            f"{held:.1f}", f"{r['sent / P']:.2f}" if r["ranks"] > 1 else "-",
            " ".join(f"{n} {mb:.1f}" for n, mb in sorted(r["passed MB"].items())) or "-",
            f"{r['ms']:.2f}", f"{r['vs stock']:.2f}x"]


def main(args):
    rows = collect_rows(args, fsdp_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print_table(args, [table_row(r) for r in rows], HEADERS, what="way")
    for r in rows:
        if "prefetch ms" in r:
            gathering, waited = r["prefetch ms"]
            print(f"{r['ranks']} ranks, {r['model']}, FSDP prefetch (rank 0): the prefetch"
                  f" thread gathered {gathering:.2f} ms per step, the main thread waited"
                  f" {waited:.2f} ms for it: {1 - waited / gathering:.0%} hidden behind compute"
                  if gathering else f"{r['ranks']} rank(s): nothing to prefetch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(args), "rows": rows}, f, indent=1)
        print(f"rows: {args.json}")
    if args.png:
        draw_memory([r for r in rows if r["model"] == args.sizes[-1]], args.png, machine(args))
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main(ARGS)
