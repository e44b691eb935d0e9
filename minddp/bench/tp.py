"""Tensor parallelism's cost: bytes sent against the formula, memory per rank, step time.

    minddp tp-bench                                    # 1, 2 and 4 gloo ranks, started here
    minddp tp-bench --world-sizes 2 --rounds 10
    minddp tp-bench --png runs/tp-memory.png           # the picture

Two pre-LN transformer blocks (width 256, 8 heads, MLP 4x), a mean over the tokens and a
10-way head, AdamW, on batches of --batch sequences of 64 tokens, the same on every rank;
six ways: DDP (ManualDDP), FSDP (the lesson's fully_shard, a unit per block), tensor
parallel (TP: q, k, v and the MLP's first layer column-split, the output projection and the
MLP's second layer row-split) and TP with sequence parallel (SP: the LayerNorms on each
rank's tokens), each TP way as minddp's and as stock's parallelize_module. Per rank, the
largest over ranks, in MB: parameters, gradients and optimizer state held, and the
activations autograd saves for backward (torch.autograd.graph.saved_tensors_hooks).

"sent" counts the bytes minddp passes to each collective in one step (stock's DTensor uses
functional collectives, not counted); "formula" is what the lesson predicts for the blocks:
per block, with A the bytes of one block's activations (batch x tokens x width x 4), TP's
forward all_reduces twice (after the output projection and the MLP) and its backward four
times (q, k and v each bring an input gradient to sum, and the MLP's first layer one); SP
replaces each all_reduce by an all_gather and a reduce_scatter, in the same places; the
LayerNorm gradients' sums over the ranks are DTensor's (Partial until the optimizer reads
them, as stock's: tp/sequence_parallel.py), not counted. Step times: medians of rounds in a
shuffled order, as ratios to stock's TP in the same run.
"""

from . import HEADS, bench_parser, check_outputs


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp tp-bench", [1, 2, 4])
    parser.set_defaults(batch=8, sizes=["4M"])  # sizes: unused here (one model)
    parser.add_argument("--png", metavar="PATH", help="draw the memory per rank (matplotlib)")
    args = parser.parse_args(argv)
    for world_size in args.world_sizes:  # the heads and widths are cut over the ranks
        if HEADS % world_size:
            parser.error(f"argument --world-sizes: the benchmark's {HEADS} attention heads do"
                         f" not split over {world_size} ranks (use 1, 2, 4 or 8)")
    return check_outputs(args, "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import copy  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor import parallel as stock_tp  # noqa: E402

from ..tp import sequence_parallel as minddp_sp  # noqa: E402
from .. import tp as minddp_tp  # noqa: E402
from ..dropin.ddp import ManualDDP  # noqa: E402
from ..fsdp.shard import fully_shard  # noqa: E402
from ..tools.pictures import draw_held_and_activations  # noqa: E402
from .harness import (collect_rows, counting_collectives, machine, print_table,  # noqa: E402
                      time_steps, timed_rounds)
from .transformer import BLOCKS, TOKENS, WIDTH, Classifier  # noqa: E402

WAYS = ["DDP", "FSDP", "TP", "TP stock", "TP+SP", "TP+SP stock"]


def plan(tp, sp, sequence):
    """The plan for one block: stock's or minddp's styles, with or without sequence parallel."""
    out = {"attn.q": tp.ColwiseParallel(), "attn.k": tp.ColwiseParallel(),
           "attn.v": tp.ColwiseParallel(), "mlp.up": tp.ColwiseParallel(),
           "attn.o": tp.RowwiseParallel(**({"output_layouts": Shard(1)} if sequence else {})),
           "mlp.down": tp.RowwiseParallel(**({"output_layouts": Shard(1)} if sequence else {}))}
    if sequence:
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
        out.update({"ln1": sp.SequenceParallel(), "ln2": sp.SequenceParallel(),
                    "attn": sp.PrepareModuleInput(**gather),
                    "mlp": sp.PrepareModuleInput(**gather)})
    return out


def build(way, base, mesh):
    model = copy.deepcopy(base)
    model.sequence_parallel = "SP" in way
    if way == "DDP":
        model = ManualDDP(model)
    elif way == "FSDP":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        tp, sp = (stock_tp, stock_tp) if way.endswith("stock") else (minddp_tp, minddp_sp)
        for block in model.blocks:
            tp.parallelize_module(block, mesh, plan(tp, sp, "SP" in way))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def held_mb(model, optimizer):
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    state = [_local(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [sum(t.numel() * t.element_size() for t in ts) / 2**20 for ts in (params, grads, state)]


def activation_mb(model, x):
    """MB autograd saves in one forward for backward, less the weights themselves (distinct
    storages; FSDP's gathered weights are freed by then, and count 0). No backward runs."""
    kept = []  # alive until the forward ends, so that no freed storage's address is reused

    def pack(t):  # the graph keeps None: a saved output kept there would hold its own graph
        kept.append(_local(t).detach())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        model(x)
    weights = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(n for ptr, n in storages.items() if ptr not in weights) / 2**20  # (not weights)


def formula_mb(way, batch, world_size):
    """The bytes the lesson predicts minddp passes to its collectives in one step, in MB."""
    a = batch * TOKENS * WIDTH * 4 / 2**20  # one block's activations
    if world_size == 1 or way not in ("TP", "TP+SP"):
        return None
    if way == "TP":
        return {"all_reduce": BLOCKS * 6 * a}
    return {"all_gather": BLOCKS * 4 * a, "reduce_scatter": BLOCKS * 4 * a}


def tp_size(size, args, rank, world_size, device):
    torch.manual_seed(0)
    base = Classifier().to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    built = {w: build(w, base, mesh) for w in WAYS}
    g = torch.Generator().manual_seed(0)  # the same batches on every rank: TP needs them
    batches = [(torch.randn(args.batch, TOKENS, WIDTH, generator=g).to(device),
                torch.randint(0, 10, (args.batch,), generator=g).to(device))
               for _ in range(args.steps)]
    measured = {}
    for w in WAYS:
        time_steps(*built[w], batches[:1] * 2, device, world_size)  # state and buckets exist
        counts = {}
        with counting_collectives(counts):
            time_steps(*built[w], batches[:1], device, world_size)
        measured[w] = held_mb(*built[w]) + [activation_mb(built[w][0], batches[0][0])], counts
    for w in WAYS:
        time_steps(*built[w], batches[:1] * args.warmup, device, world_size)
    samples = timed_rounds(built, batches, args.rounds, device, world_size)
    stock = statistics.median(samples["TP stock"])
    rows = []
    for w in WAYS:
        mb, counts = measured[w]
        everyone = [torch.zeros(4) for _ in range(world_size)]
        dist.all_gather(everyone, torch.tensor(mb))
        largest = torch.stack(everyone).max(dim=0).values.tolist()
        passed = {_short(n): b / 2**20 for n, b in counts.items() if b}
        median = statistics.median(samples[w])
        rows.append({"ranks": world_size, "model": f"{BLOCKS} blocks", "way": w,
                     "params": largest[0], "grads": largest[1], "optimizer": largest[2],
                     "activations": largest[3], "passed MB": passed,
                     "formula MB": formula_mb(w, args.batch, world_size),
                     "ms": median * 1e3, "vs stock": median / stock})
    del mesh
    return rows


def _short(name):  # all_gather_single -> all_gather
    return name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")


HEADERS = ["ranks", "way", "params MB", "grads MB", "optimizer MB", "activations MB",
           "collectives (MB passed)", "formula (MB)", "median ms/step", "vs stock TP"]


def table_row(r):
    fmt = lambda d: " ".join(f"{n} {mb:.2f}" for n, mb in sorted(d.items())) if d else "-"  # noqa
    return [r["ranks"], r["way"], *(f"{r[k]:.2f}" for k in
                                    ("params", "grads", "optimizer", "activations")),
            fmt(r["passed MB"]), fmt(r["formula MB"]) if r["formula MB"] else "-",
            f"{r['ms']:.2f}", f"{r['vs stock']:.2f}x"]


def main(args):
    args.sizes = ["tp"]  # one model: the blocks above
    rows = collect_rows(args, tp_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print_table(args, [table_row(r) for r in rows], HEADERS, what="way")
    if args.png:
        draw_held_and_activations(
            rows, args.png, machine(args),
            title=f"What each rank holds: {BLOCKS} transformer blocks (width {WIDTH}), AdamW,"
                  f" batch {args.batch} x {TOKENS} tokens",
            caption="Every way trains on the same batch on every rank. TP: a slice of each"
                    " layer per rank; SP: also a slice of the tokens between the splits."
                    " Largest rank.")
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main(ARGS)
