"""Expert parallelism's cost: tokens per expert, the bytes of the all_to_alls, what each rank holds.

    minddp ep-bench                                   # 2 and 4 gloo ranks, started here
    minddp ep-bench --world-sizes 4 --png docs/experts-load.png --format github

The MoE GPT (minddp.bench.transformer.moe_gpt: width 32, 2 blocks, 8 experts per block,
top-1, 16 tokens) under minddp's expert parallelism over every rank (ep = W), each rank its
own sequences of a learnable toy language (the next token is 3t + 1 mod 32, 70% of the time):

  load       --load-steps AdamW steps with the balancing loss's weight 0, 0.01 and 0.1: the
             pairs each expert takes per step (the first block, every rank's summed), as the
             busiest expert's share against an even one (max / mean; 1 is even)
  sent       the bytes one training step passes to all_to_all_single, per rank: the counts
             (E x 8 bytes per layer), the rows sent out (the rank's pairs, N k d x 4 bytes)
             and sent back (the rows its experts took), forward and again backward (the
             gradients the other way), against that formula from the step's own routing
  held       the parameter bytes per rank, experts split over the ranks against every expert
             on every rank (what data parallelism would hold), against the formula
  step       a training step, slowest rank, median over --rounds: expert parallel at W ranks
             beside one process running the same layer on its own sequences, all experts
             local (no all_to_all), as a ratio
--png draws the load over the steps for the three weights, and each expert's pairs.
"""

from . import at_least, bench_parser, check_outputs

SIZES = dict(vocab=32, d=32, heads=4, blocks=2, tokens=16, experts=8, top_k=1)
WEIGHTS = (0.0, 0.01, 0.1)


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp ep-bench", [2, 4])
    parser.set_defaults(batch=4, sizes=["moe"], rounds=10)
    parser.add_argument("--load-steps", type=at_least(1), default=150,
                        help="AdamW steps of the load table, per balancing weight")
    parser.add_argument("--png", metavar="PATH", help="draw the load (matplotlib)")
    args = parser.parse_args(argv)
    for world_size in args.world_sizes:
        if SIZES["experts"] % world_size:
            parser.error(f"argument --world-sizes: {SIZES['experts']} experts do not split"
                         f" over {world_size} ranks")
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

from ..ep.parallel import expert_parallel, sync_gradients  # noqa: E402
from ..mesh.device_mesh import init_device_mesh  # noqa: E402
from .harness import collect_rows, machine  # noqa: E402
from .transformer import moe_gpt  # noqa: E402


def sequences(batch, seed):
    """A toy language with something to learn: the next token is 3t + 1 (mod 32), 70%."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, SIZES["vocab"], (batch, SIZES["tokens"] + 1), generator=g)
    for t in range(1, x.shape[1]):
        follow = torch.rand(batch, generator=g) < 0.7
        x[:, t] = torch.where(follow, (x[:, t - 1] * 3 + 1) % SIZES["vocab"], x[:, t])
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def model_of(mesh=None):
    torch.manual_seed(0)
    model = moe_gpt(**SIZES)
    return expert_parallel(model, mesh) if mesh is not None else model


def train_step(model, optimizer, x, y, weight, mesh=None):
    logits = model(x)
    balance = sum(block.mlp.balance_loss for block in list(model)[1:-1])
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + weight * balance
    optimizer.zero_grad()
    loss.backward()
    if mesh is not None:
        sync_gradients(model, mesh)
    optimizer.step()


@contextlib.contextmanager
def counting(sent):
    """sent: the bytes passed to all_to_all_single, by what they carry (counts or rows)."""
    original = dist.all_to_all_single

    def call(output, input, *args, **kwargs):
        kind = "counts" if input.dtype == torch.long else "rows"
        sent[kind] = sent.get(kind, 0) + input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)
    dist.all_to_all_single = call
    try:
        yield
    finally:
        dist.all_to_all_single = original


def ep_size(size, args, rank, world_size, device):
    """One world size: the rows of the load, sent, held and step tables (a collective)."""
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ep",))
    rows = []
    for weight in WEIGHTS:
        model = model_of(mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loads = []
        for step in range(args.load_steps):
            train_step(model, optimizer, *sequences(args.batch, 1000 * step + rank), weight, mesh)
            counts = model[1].mlp.tokens_per_expert.clone()
            dist.all_reduce(counts)  # every rank's pairs per expert
            loads.append(counts.tolist())
        rows.append({"table": "load", "ranks": world_size, "weight": weight, "loads": loads})
    model = model_of(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = sequences(args.batch, rank)
    sent = {}
    with counting(sent):
        train_step(model, optimizer, x, y, 0.01, mesh)
    pairs = [block.mlp.tokens_per_expert for block in list(model)[1:-1]]
    d, n, k = SIZES["d"], x.numel(), SIZES["top_k"]
    # per layer: the counts once; the rows out (n k) and back (what my experts took), and
    # both again in backward, the gradients going the other way
    formula = {"counts": len(pairs) * SIZES["experts"] * 8,
               "rows": 2 * sum(n * k * d * 4 + taken * d * 4
                               for taken in _taken(pairs, rank, world_size))}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"sent": sent, "formula": formula})
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model_of().parameters())
    expert_bytes = sum(p.numel() * p.element_size() for n_, p in model_of().named_parameters()
                       if ".experts." in n_)
    rows.append({"table": "sent", "ranks": world_size, "per_rank": everyone, "held": held,
                 "whole": whole, "held_formula": whole - expert_bytes * (1 - 1 / world_size)})
    one = model_of()  # the same layer, one process, every expert here, this rank's tokens
    optimizers = {"ep": optimizer, "one": torch.optim.AdamW(one.parameters(), lr=3e-3)}
    models = {"ep": model, "one": one}
    times = {"ep": [], "one": []}
    for r in range(args.warmup + args.rounds):
        for way in (("ep", "one") if r % 2 else ("one", "ep")):
            dist.barrier()
            start = time.perf_counter()
            train_step(models[way], optimizers[way], x, y, 0.01, mesh if way == "ep" else None)
            took = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r >= args.warmup:
                times[way].append(took.item())
    rows.append({"table": "step", "ranks": world_size,
                 **{way: statistics.median(t) * 1e3 for way, t in times.items()}})
    return rows


def _taken(per_layer, rank, world_size):
    """Per layer, the pairs this rank's experts took from every rank (a collective)."""
    taken = []
    for counts in per_layer:  # (E,): this rank's pairs per expert, experts in rank runs
        parts = [torch.empty_like(counts) for _ in range(world_size)]
        dist.all_gather(parts, counts)
        taken.append(int(torch.stack(parts).view(world_size, world_size, -1)[:, rank].sum()))
    return taken


def load_ratio(loads, last=10):
    """The busiest expert's pairs over the mean, over the last steps."""
    ratios = [max(step) / (sum(step) / len(step)) for step in loads[-last:]]
    return sum(ratios) / len(ratios)


def main(args):
    rows = collect_rows(args, ep_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print(f"{machine(args)} | MoE GPT width {SIZES['d']}, {SIZES['blocks']} blocks,"
          f" {SIZES['experts']} experts, top-{SIZES['top_k']}")
    print("\nload: the busiest expert's pairs / the mean (1: even), first block")
    print(tabulate([[r["ranks"], r["weight"], f"{load_ratio(r['loads'][:1], 1):.2f}",
                     f"{load_ratio(r['loads']):.2f}"] for r in rows if r["table"] == "load"],
                   headers=["ranks", "balancing weight", "step 1",
                            f"last 10 of {args.load_steps} steps"],
                   tablefmt=args.format, disable_numparse=True))
    print("\nsent to all_to_all_single in one step, per rank (bytes), and parameters held:")
    table = []
    for r in (r for r in rows if r["table"] == "sent"):
        for rank, p in enumerate(r["per_rank"]):
            table.append([r["ranks"], rank, p["sent"].get("counts", 0), p["sent"].get("rows", 0),
                          "yes" if p["sent"] == p["formula"] else "NO",
                          f"{r['held'] / 2**20:.3f}", f"{r['whole'] / 2**20:.3f}",
                          "yes" if r["held"] == r["held_formula"] else "NO"])
    print(tabulate(table, headers=["ranks", "rank", "counts", "rows", "= formula",
                                   "held MiB (ep)", "held MiB (every expert)", "= formula"],
                   tablefmt=args.format, disable_numparse=True))
    print("\na training step, slowest rank (ms):")
    print(tabulate([[r["ranks"], f"{r['ep']:.1f}", f"{r['one']:.1f}", f"{r['ep'] / r['one']:.2f}x"]
                    for r in rows if r["table"] == "step"],
                   headers=["ranks", "expert parallel", "one process, own tokens", "ratio"],
                   tablefmt=args.format, disable_numparse=True))
    if args.png:
        draw(rows, args.png, machine(args))
        print(f"picture: {args.png}")


def draw(rows, path, machine_line):
    """The load over the steps per balancing weight, and each expert's pairs (heat maps)."""
    from ..tools.pictures import _pyplot, save
    plt = _pyplot()
    world_size = max(r["ranks"] for r in rows)
    loads = {r["weight"]: r["loads"] for r in rows if r["table"] == "load"
             and r["ranks"] == world_size}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for weight, per_step in loads.items():
        axes[0].plot([max(s) / (sum(s) / len(s)) for s in per_step], label=f"weight {weight}")
    axes[0].axhline(1, color="gray", linestyle="--", linewidth=0.8)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("busiest expert's pairs / mean")
    axes[0].set_title(f"load, {world_size} ranks (first block)", fontsize=9)
    axes[0].legend(fontsize=8)
    for ax, weight in zip(axes[1:], (0.0, 0.01)):
        image = ax.imshow(torch.tensor(loads[weight], dtype=torch.float).T.numpy(),
                          aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(f"pairs per expert, balancing weight {weight}", fontsize=9)
        fig.colorbar(image, ax=ax)
    save(fig, path, machine_line)
    plt.close(fig)
    return {weight: [max(s) / (sum(s) / len(s)) for s in per_step]
            for weight, per_step in loads.items()}


if __name__ == "__main__":
    main(ARGS)
