"""Context parallelism's cost: who computes what, the bytes round the ring, activations per rank.

    minddp cp-bench                                    # 2 and 4 gloo ranks, started here
    minddp cp-bench --world-sizes 4 --png docs/context-work.png --format github

A GPT (minddp.bench.transformer.gpt: vocabulary 64, width 64, 4 heads, 2 blocks) on one
sequence of --tokens tokens per step, under minddp's context_parallel over every rank (the
weights replicated: no gradient averaging is timed), causal attention, both layouts:

  work       per rank, the (query, key) pairs its attention kernels compute in one forward
             (counted at each kernel call: a part's rows x keys, the causal triangle's half
             on the diagonal), against the formula: in order, rank r computes r full blocks
             and one triangle, c^2 r + c(c+1)/2 with c = T/W; zig-zag every rank T(T+1)/(2W).
             And the milliseconds each rank spends in those kernels, forward and backward
             (median over --rounds steps): the imbalance that zig-zag removes, timed
  sent       the bytes each rank passes to the ring's isend in one step (forward and
             backward, every block), against the formula: per attention layer, the keys and
             values (W-1) times forward and (W-1) times backward, their float32 gradient W
             times, each message 2 b (T/W) d x 4 bytes (d, the width): (3W-2) 8b(T/W)d
  step       a training step (forward, backward), slowest rank, median over rounds: minddp's
             ring beside stock's (references/stock_context.py), the same layout, as a ratio
  memory     MiB autograd saves for backward in one forward of the GPT: one process on the
             whole sequence, and the largest rank under context parallelism, at 4 lengths
--png draws who computes which blocks (both layouts), the pairs per rank and the memory.
"""

from . import at_least, bench_parser, check_outputs

SIZES = dict(vocab=64, d=64, heads=4, blocks=2)
LAYOUTS = {"in-order": False, "zigzag": True}


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp cp-bench", [2, 4])
    parser.set_defaults(batch=1, sizes=["gpt"], rounds=10)
    parser.add_argument("--tokens", type=at_least(8), default=512, help="T, tokens per sequence")
    parser.add_argument("--lengths", nargs="+", type=at_least(8), default=[256, 512, 1024, 2048],
                        help="sequence lengths of the memory table")
    parser.add_argument("--png", metavar="PATH", help="draw the work and memory (matplotlib)")
    args = parser.parse_args(argv)
    for world_size in args.world_sizes:
        for length in [args.tokens, *args.lengths]:
            if length % (2 * world_size):
                parser.error(f"argument --tokens/--lengths: {length} tokens do not split in"
                             f" 2 x {world_size} zig-zag chunks")
    return check_outputs(args, "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from ..cp import blockwise, ring_attention as context  # noqa: E402
from ..cp.context_parallel import context_parallel  # noqa: E402
from ..references.stock_context import context_parallel as stock_context_parallel  # noqa: E402
from .harness import collect_rows, machine  # noqa: E402
from .tp import activation_mb  # noqa: E402
from .transformer import gpt  # noqa: E402


@contextlib.contextmanager
def counting(seen):
    """seen["pairs"], seen["kernel_s"], seen["sent"]: what the ring's kernels and isends do."""
    kernels = dict(blockwise.KERNELS)
    pass_on = context.pass_on

    def timed(kernel, forward):
        def call(q, k, v, *rest):
            if forward:  # the pairs this call computes: the triangle's on the diagonal
                n, m, causal = q.shape[2], k.shape[2], rest[-2]
                pairs = n * (n + 1) // 2 if causal else n * m
                seen["pairs"] += q.shape[0] * q.shape[1] * pairs
            start = time.perf_counter()
            out = kernel(q, k, v, *rest)
            seen["kernel_s"] += time.perf_counter() - start
            return out
        return call

    def sending(tensor, group, tag):
        if dist.get_world_size(group) > 1:
            seen["sent"] += tensor.numel() * tensor.element_size()
        return pass_on(tensor, group, tag)
    for name, (forward, backward) in kernels.items():
        blockwise.KERNELS[name] = (timed(forward, True), timed(backward, False))
    context.pass_on = sending
    try:
        yield
    finally:
        blockwise.KERNELS.update(kernels)
        context.pass_on = pass_on


def step(model, tokens, targets, mesh, way, zigzag):
    """One forward and backward under `way`'s context_parallel, on fresh copies of the data."""
    x, y = tokens.clone(), targets.clone()
    cp = context_parallel if way == "minddp" else stock_context_parallel
    with cp(mesh, buffers=[x, y, model[0].positions], buffer_seq_dims=[1, 1, 0], zigzag=zigzag):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def formulas(world_size, tokens, batch, zigzag):
    """(pairs per rank, bytes sent per rank per step) that the lesson predicts."""
    c = tokens // world_size
    rank = dist.get_rank()
    heads = SIZES["heads"]
    pairs = (tokens * (tokens + 1) // (2 * world_size) if zigzag
             else c * c * rank + c * (c + 1) // 2)
    block = 2 * batch * c * SIZES["d"] * 4  # keys and values, float32
    sent = 0 if world_size == 1 else SIZES["blocks"] * ((2 * world_size - 2) + world_size) * block
    return batch * heads * pairs * SIZES["blocks"], sent


def cp_size(size, args, rank, world_size, device):
    """One world size: the rows of the work, sent, step and memory tables (a collective)."""
    from ..mesh.device_mesh import init_device_mesh
    from torch.distributed.device_mesh import init_device_mesh as stock_mesh
    meshes = {"minddp": init_device_mesh(device.type, (world_size,)),
              "stock": stock_mesh(device.type, (world_size,))}
    torch.manual_seed(0)
    model = gpt(**SIZES, tokens=args.tokens).to(device)
    g = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, SIZES["vocab"], (args.batch, args.tokens + 1), generator=g)
    tokens, targets = sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()
    rows = []
    for layout, zigzag in LAYOUTS.items():
        seen = {"pairs": 0, "kernel_s": 0.0, "sent": 0}
        with counting(seen):
            step(model, tokens, targets, meshes["minddp"], "minddp", zigzag)
        pairs, sent = seen["pairs"], seen["sent"]
        kernel_ms, times = [], {"minddp": [], "stock": []}
        for r in range(args.warmup + args.rounds):
            for way in (("minddp", "stock") if r % 2 else ("stock", "minddp")):
                dist.barrier()
                seen["kernel_s"], start = 0.0, time.perf_counter()
                with counting(seen) if way == "minddp" else contextlib.nullcontext():
                    step(model, tokens, targets, meshes[way], way, zigzag)
                took = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                if r >= args.warmup:
                    times[way].append(took.item())
                    if way == "minddp":
                        kernel_ms.append(seen["kernel_s"] * 1e3)
        mine = {"pairs": pairs, "formula": formulas(world_size, args.tokens, args.batch,
                                                    zigzag), "sent": sent,
                "kernel_ms": statistics.median(kernel_ms)}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        rows.append({"table": "work", "ranks": world_size, "layout": layout,
                     "per_rank": everyone, "minddp_ms": statistics.median(times["minddp"]) * 1e3,
                     "stock_ms": statistics.median(times["stock"]) * 1e3})
    for length in args.lengths:
        torch.manual_seed(0)
        model = gpt(**SIZES, tokens=length).to(device)
        x = torch.randint(0, SIZES["vocab"], (args.batch, length), generator=g)
        one = activation_mb(model, x)  # one process, the whole sequence (here, alone)
        with context_parallel(meshes["minddp"], buffers=[x, model[0].positions],
                              buffer_seq_dims=[1, 0]):
            per_rank = torch.tensor(activation_mb(model, x))
        dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
        rows.append({"table": "memory", "ranks": world_size, "tokens": length,
                     "one": one, "per_rank": per_rank.item()})
    return rows


def work_rows(rows):
    out = []
    for r in rows:
        if r["table"] == "work":
            pairs = [p["pairs"] for p in r["per_rank"]]
            out.append([r["ranks"], r["layout"], " ".join(f"{p:,}" for p in pairs),
                        "yes" if all(p["pairs"] == p["formula"][0] for p in r["per_rank"])
                        else "NO", f"{max(pairs) / min(pairs):.2f}",
                        " ".join(f"{p['kernel_ms']:.1f}" for p in r["per_rank"]),
                        f"{max(p['sent'] for p in r['per_rank']) / 2**20:.3f}",
                        "yes" if all(p["sent"] == p["formula"][1] for p in r["per_rank"])
                        else "NO", f"{r['minddp_ms']:.1f}", f"{r['stock_ms']:.1f}",
                        f"{r['minddp_ms'] / r['stock_ms']:.2f}x"])
    return out


WORK_HEADERS = ["ranks", "layout", "pairs per rank", "= formula", "max/min",
                "kernel ms per rank", "sent MiB/step", "= formula", "step ms, minddp",
                "step ms, stock", "minddp/stock"]


def main(args):
    rows = collect_rows(args, cp_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print(f"{machine(args)} | GPT width {SIZES['d']}, {SIZES['blocks']} blocks, causal,"
          f" {args.tokens} tokens | {args.rounds} rounds")
    print(tabulate(work_rows(rows), headers=WORK_HEADERS, tablefmt=args.format,
                   disable_numparse=True))
    memory = [[r["ranks"], r["tokens"], f"{r['one']:.2f}", f"{r['per_rank']:.2f}",
               f"{r['one'] / r['per_rank']:.2f}"] for r in rows if r["table"] == "memory"]
    print("\nactivations saved for backward, one forward (MiB):")
    print(tabulate(memory, headers=["ranks", "tokens", "one process", "largest rank, cp",
                                    "one process / rank"],
                   tablefmt=args.format, disable_numparse=True))
    if args.png:
        draw(rows, args.png, machine(args))
        print(f"picture: {args.png}")


def draw(rows, path, machine_line):
    """The picture: who computes which blocks (both layouts), pairs per rank, memory."""
    from ..tools.pictures import _pyplot, save
    plt = _pyplot()
    world_size = max(r["ranks"] for r in rows)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (layout, zigzag) in zip(axes, LAYOUTS.items()):
        chunks = 2 * world_size
        owner = [c // 2 for c in range(chunks)] if not zigzag else [
            min(c, chunks - 1 - c) for c in range(chunks)]  # the rank holding each chunk
        grid = torch.full((chunks, chunks), float("nan"))
        for q in range(chunks):
            grid[q, :q + 1] = owner[q]  # queries stay: the chunk's rank computes its row
        ax.imshow(grid.numpy(), cmap="tab10", vmin=0, vmax=9)
        ax.set_title(f"{layout}: who computes each block", fontsize=9)
        colours = plt.get_cmap("tab10")
        ax.legend(handles=[plt.matplotlib.patches.Patch(color=colours(r), label=f"rank {r}")
                           for r in range(world_size)], fontsize=7, loc="upper right")
        ax.set_xlabel("key chunk")
        ax.set_ylabel("query chunk")
    work = [r for r in rows if r["table"] == "work" and r["ranks"] == world_size]
    bars = {}
    for i, r in enumerate(work):
        bars[r["layout"]] = pairs = [p["pairs"] / 1e6 for p in r["per_rank"]]
        axes[2].bar([x + 0.4 * i for x in range(world_size)], pairs, width=0.4,
                    label=r["layout"])
    axes[2].set_xlabel("rank")
    axes[2].set_ylabel("million (query, key) pairs per forward")
    axes[2].set_title(f"attention work per rank, {world_size} ranks", fontsize=9)
    axes[2].legend(fontsize=8)
    memory = [r for r in rows if r["table"] == "memory" and r["ranks"] == world_size]
    lengths = [r["tokens"] for r in memory]
    axes[3].plot(lengths, [r["one"] for r in memory], marker="o", label="one process")
    axes[3].plot(lengths, [r["per_rank"] for r in memory], marker="o",
                 label=f"per rank, {world_size} ranks")
    axes[3].set_xlabel("sequence length")
    axes[3].set_ylabel("MiB saved for backward")
    axes[3].set_title("activations", fontsize=9)
    axes[3].legend(fontsize=8)
    save(fig, path, machine_line)
    plt.close(fig)
    return bars  # the pairs drawn per layout and rank (millions), for the test


if __name__ == "__main__":
    main(ARGS)
