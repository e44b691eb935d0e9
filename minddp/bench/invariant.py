"""The invariant mode's price: step time and memory per mesh, beside the normal mode.

    minddp invariant-bench                           # 1, 2 and 4 gloo ranks, started here
    minddp invariant-bench --world-sizes 2 --rounds 10
    minddp invariant-bench --png docs/invariant.png  # the picture (tools/tree_picture.py)

A GPT (bench/transformer.py's gpt: vocabulary 512, width 64, 4 heads, 4 blocks, 32 tokens,
untied) trained on each mesh of MESHES twice, on the same global batch of --batch sequences:
in the normal mode (mesh/compose.py with minddp's calls: fully_shard over dp, TP on the
blocks, 1F1B with max(2, pp) microbatches; each dp rank its batch / dp sequences) and in the
invariant mode (invariant/step.py: 8 virtual shards, 4 chunks, fully_shard's storage with
the tree's sum). A step is zero_grad, every forward and backward, the sums, AdamW's step.
Timed in rounds, both modes one step each per round in a shuffled order; "invariant /
normal" is the median over rounds of each round's ratio (middle half in brackets).
Memory per rank, the largest rank's, in MB: the weights, gradients and AdamW state held after
a step, and the activations one forward keeps for backward (the normal mode: the rank's
batch at once, or one microbatch under pp; the invariant mode: one shard, as it runs them).
"""

from . import bench_parser, check_outputs

MESHES = {1: ["dp=1"], 2: ["dp=2", "tp=2", "pp=2"], 4: ["dp=4", "dp=2,tp=2", "pp=2,tp=2"]}
SIZES = dict(vocab=512, d=64, heads=4, blocks=4, tokens=32, tied=False)


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp invariant-bench", [1, 2, 4])
    parser.set_defaults(batch=8, sizes=["gpt"], rounds=20, threads=1)
    parser.add_argument("--png", metavar="PATH",
                        help="draw the tree and the price per mesh (matplotlib)")
    args = parser.parse_args(argv)
    if args.threads != 1:
        parser.error("argument --threads: the invariant mode runs one intra-op thread")
    for world_size in args.world_sizes:
        if world_size not in MESHES:
            parser.error(f"argument --world-sizes: meshes are listed for 1, 2 and 4 ranks,"
                         f" not {world_size}")
    return check_outputs(args, "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from ..invariant.step import InvariantTraining  # noqa: E402
from ..mesh.compose import parallelize, pipeline  # noqa: E402
from ..mesh.plan import parse_mesh  # noqa: E402
from ..references.libraries import LIBRARIES  # noqa: E402
from .harness import collect_rows, machine, per_round  # noqa: E402
from .tp import activation_mb, held_mb  # noqa: E402
from .transformer import gpt  # noqa: E402


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _normal(mesh, sizes, coordinate, x, y):
    """The normal mode's step on this rank; (step, stage, optimizer, one forward's input)."""
    lib = LIBRARIES["manual"]
    stage = parallelize(gpt(**SIZES), mesh, lib)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, foreach=False)
    dp, rank = sizes.get("dp", 1), coordinate.get("dp", 0)
    x, y = (t.chunk(dp)[rank] for t in (x, y))  # this dp rank's sequences
    pp = sizes.get("pp", 1)
    schedule = pipeline(stage, mesh, lib, next_token_loss, max(2, pp)) if pp > 1 else None
    first, last = coordinate.get("pp", 0) == 0, coordinate.get("pp", 0) == pp - 1

    def step():
        optimizer.zero_grad()
        if schedule is None:
            next_token_loss(stage(x), y).backward()
        else:
            schedule.step(*([x] if first else []), target=y if last else None)
        optimizer.step()
    return step, stage, optimizer, x.chunk(max(2, pp))[0] if pp > 1 else x


def _invariant(mesh, x, y, batch):
    torch.manual_seed(0)
    training = InvariantTraining(gpt(**SIZES), mesh, shards=8, chunks=4, batch=batch,
                                 fully_shard=LIBRARIES["manual"].fully_shard)
    optimizer = torch.optim.AdamW(training.stage.parameters(), lr=1e-3, foreach=False)
    count = iter(range(10**9))

    def step():
        optimizer.zero_grad()
        training.step(next(count), x, y)
        optimizer.step()
    return step, training.stage, optimizer, training.mine(x).chunk(training.here)[0]


def _activations(stage, x, first):
    stage_input = x if first else torch.randn(*x.shape, SIZES["d"])
    return activation_mb(stage, stage_input)


def measure(text, args, world_size):
    """One mesh, both modes: their rows' figures on this rank (a collective)."""
    shape, names = parse_mesh(text)
    mesh = LIBRARIES["manual"].init_device_mesh("cpu", shape, mesh_dim_names=names)
    sizes, coordinate = dict(zip(names, shape)), dict(zip(names, mesh.get_coordinate()))
    tokens = torch.randint(0, SIZES["vocab"], (args.batch, SIZES["tokens"] + 1),
                           generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    torch.manual_seed(0)
    modes = {"normal": _normal(mesh, sizes, coordinate, x, y),
             "invariant": _invariant(mesh, x, y, args.batch)}
    for step, *_ in modes.values():
        for _ in range(args.warmup + 1):
            step()  # AdamW's state exists
    first = coordinate.get("pp", 0) == 0
    figures = {m: [*held_mb(stage, optimizer), _activations(stage, one, first)]
               for m, (_, stage, optimizer, one) in modes.items()}
    samples = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in random.Random(r).sample(list(modes), len(modes)):
            if world_size > 1:
                dist.barrier()  # every rank starts the step together
            start = time.perf_counter()
            modes[m][0]()
            took = torch.tensor([time.perf_counter() - start])
            if world_size > 1:
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            samples[m].append(took.item())
    return figures, samples


def invariant_size(size, args, rank, world_size, device):
    rows = []
    for text in MESHES[world_size]:
        figures, samples = measure(text, args, world_size)
        everyone = [figures]
        if world_size > 1:
            everyone = [None] * world_size
            dist.all_gather_object(everyone, figures)
        for mode in ("normal", "invariant"):
            largest = [max(f[mode][i] for f in everyone) for i in range(4)]
            rows.append([world_size, text, mode, *(f"{v:.3f}" for v in largest),
                         f"{statistics.median(samples[mode]) * 1e3:.1f}",
                         per_round(samples[mode], samples["normal"])])
    return rows


HEADERS = ["ranks", "mesh", "mode", "params MB", "grads MB", "optimizer MB", "activations MB",
           "median ms/step", "vs normal"]


def main(args):
    rows = collect_rows(args, invariant_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print(machine(args) + f" | {args.rounds} rounds, one step per mode each")
    print(tabulate(rows, headers=HEADERS, tablefmt=args.format, disable_numparse=True))
    if args.png:
        from ..tools.tree_picture import draw_invariant
        draw_invariant([{"mesh": r[1], "mode": r[2], "ratio": float(r[-1].split("x")[0])}
                        for r in rows], args.png, machine(args))
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main(ARGS)
