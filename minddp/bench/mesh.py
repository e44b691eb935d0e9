"""The mesh's cost: what each rank holds and sends along each dimension, minddp vs stock.

    minddp mesh-bench                                  # 4 and 8 gloo ranks, started here
    minddp mesh-bench --world-sizes 4 --png runs/mesh-memory.png

A GPT (minddp.bench.transformer.gpt: vocabulary 512, width 64, 4 heads, 4 blocks, 32
tokens, untied) trained as examples/gpt_nd.py trains it (compose.py: pipeline stages, TP
on the blocks, fully_shard over dp; 1F1B with max(2, pp) microbatches) on every mesh of MESHES,
once with minddp's calls and once with stock's, AdamW, --batch sequences per dp rank.

Per rank, the largest over ranks, in MB: the parameters, gradients and AdamW state it
holds after a step, and the activations autograd saves in one forward of its stage on its
batch. "formula" is what the composition predicts for the weights: each weight of this
rank's stage, divided by tp where TP splits it (the column splits' weights and biases, the
row splits' weights) and by dp (fully_shard; HSDP: by dp_shard, each shard replicated over
dp_replicate); gradients the same; AdamW two of each plus a 4-byte step count per tensor.
"sent" is the bytes passed to collectives in one step along each dimension (all_reduce and
broadcast: the tensor; all_gather: its output; reduce_scatter: its input; a pipeline's
isend: the tensor). Stock's DTensor sends TP's activations through functional collectives,
which this count does not see: its tp column says what it saw.
"""

from . import bench_parser, check_outputs

MESHES = {4: ["dp=4", "tp=4", "pp=4", "dp=2,tp=2", "pp=2,dp=2", "pp=2,tp=2",
              "dp_replicate=2,dp_shard=2"],
          8: ["dp=8", "dp=2,tp=4", "pp=2,dp=4", "pp=4,dp=2", "pp=2,dp=2,tp=2",
              "dp_replicate=2,dp_shard=2,tp=2"]}
SIZES = dict(vocab=512, d=64, heads=4, blocks=4, tokens=32, tied=False)


def parse(argv=None):
    parser = bench_parser(__doc__, "minddp mesh-bench", [4, 8])
    parser.set_defaults(batch=8, sizes=["gpt"], rounds=1)  # one model; nothing timed
    parser.add_argument("--png", metavar="PATH", help="draw the memory per rank (matplotlib)")
    args = parser.parse_args(argv)
    for world_size in args.world_sizes:
        if world_size not in MESHES:
            listed = " and ".join(map(str, MESHES))
            parser.error(f"argument --world-sizes: meshes are listed for {listed} ranks,"
                         f" not {world_size}")
    return check_outputs(args, "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment, not torch's import time


import contextlib  # noqa: E402
import inspect  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ..mesh.compose import blocks_of, parallelize, pipeline, tp_plan  # noqa: E402
from ..references.libraries import LIBRARIES  # noqa: E402
from ..mesh.plan import parse_mesh  # noqa: E402
from ..pp.stage import stage_layers  # noqa: E402
from ..tools.pictures import draw_held_and_activations  # noqa: E402
from tabulate import tabulate  # noqa: E402

from .harness import collect_rows, machine  # noqa: E402
from .tp import activation_mb, held_mb  # noqa: E402
from .transformer import gpt  # noqa: E402

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "isend")


@contextlib.contextmanager
def sent_by_dimension(counts, dimension_of):
    """Add the bytes passed to each collective to counts[dimension_of(its group)]."""
    c10d = dist.distributed_c10d
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name, original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            if name.startswith("all_gather"):
                out = given.get("tensor_list", given.get("output_tensor"))
                tensors = out if isinstance(out, list) else [out]
            else:
                tensors = [given.get("input", given.get("tensor"))]
            where = dimension_of(given.get("group"))
            counts[where] = counts.get(where, 0) + sum(t.numel() * t.element_size()
                                                       for t in tensors)
            return original(*args, **kwargs)
        return call
    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    # Stock's pipeline hands dist.isend to a P2POp, which checks it against c10d's own: the
    # same counted function in both places keeps that check true.
    c10d_isend, c10d.isend = c10d.isend, dist.isend
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        c10d.isend = c10d_isend


def formula_mb(model, sizes, coordinate):
    """MB this rank holds by the composition's arithmetic: (params, grads, AdamW state)."""
    stage = model
    if "pp" in sizes:
        stage = stage_layers(model, coordinate["pp"], sizes["pp"])
    split, count = 0.0, 0
    plan = tp_plan(LIBRARIES["manual"].tp)
    for layer in stage:
        for name, p in layer.named_parameters():
            module, attr = name.rsplit(".", 1)
            style = plan.get(module) if any(layer is b for b in blocks_of(stage)) else None
            cut = style is not None and (attr == "weight" or "Colwise" in type(style).__name__)
            dp = sizes.get("dp", sizes.get("dp_shard", 1))  # HSDP: cut over dp_shard only
            split += p.numel() * 4 / (sizes.get("tp", 1) if cut else 1) / dp
            count += 1
    mb = split / 2**20
    return mb, mb, 2 * mb + count * 4 / 2**20


def measure(text, impl, batch, device):
    """One mesh, one implementation, on every rank: this rank's figures (a collective)."""
    shape, names = parse_mesh(text)
    lib = LIBRARIES[impl]
    mesh = lib.init_device_mesh(device.type, shape, mesh_dim_names=names)
    sizes, coordinate = dict(zip(names, shape)), dict(zip(names, mesh.get_coordinate()))
    groups = {tuple(dist.get_process_group_ranks(mesh[n].get_group())): n for n in names}
    torch.manual_seed(0)
    model = gpt(**SIZES).to(device)
    formula = formula_mb(model, sizes, coordinate)
    stage = parallelize(model, mesh, lib)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, foreach=False)
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa
    microbatches = max(2, sizes.get("pp", 1))  # 1F1B: at least one per stage
    schedule = pipeline(stage, mesh, lib, loss_fn, microbatches) if "pp" in names else None
    first, last = coordinate.get("pp", 0) == 0, coordinate.get("pp", 0) == sizes.get("pp", 1) - 1
    dp_rank = coordinate.get("dp", coordinate.get("dp_replicate", 0) * sizes.get("dp_shard", 1)
                             + coordinate.get("dp_shard", 0))  # HSDP's dp ranks row by row
    g = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(0, SIZES["vocab"], (batch, SIZES["tokens"] + 1), generator=g)
    # (contiguous: stock's pipeline stage on torch 2.11 refuses a view's strides)
    x, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    def step():
        optimizer.zero_grad()
        if schedule is None:
            loss_fn(stage(x), y).backward()
        else:
            schedule.step(*([x] if first else []), target=y if last else None)
        optimizer.step()
    step()  # AdamW's state exists
    sent = {}
    dimension_of = lambda group: groups.get(  # noqa: E731  (None: the whole world)
        tuple(dist.get_process_group_ranks(group)) if group is not None else None, "world")
    with sent_by_dimension(sent, dimension_of):
        step()
    held = held_mb(stage, optimizer)
    stage_input = x if first else torch.randn(batch, SIZES["tokens"], SIZES["d"], device=device)
    activations = activation_mb(stage, stage_input)
    return {"held": [*held, activations], "formula": list(formula),
            "sent": {n: b / 2**20 for n, b in sent.items()}}


def mesh_size(size, args, rank, world_size, device):
    rows = []
    for text in MESHES[world_size]:
        for impl in ("manual", "stock"):
            mine = measure(text, impl, args.batch, device)
            everyone = [None] * world_size
            dist.all_gather_object(everyone, mine)
            largest = [max(r["held"][i] for r in everyone) for i in range(4)]
            formula = [max(r["formula"][i] for r in everyone) for i in range(3)]
            dims = sorted({d for r in everyone for d in r["sent"]})
            sent = {d: max(r["sent"].get(d, 0) for r in everyone) for d in dims}
            short = text.replace("dp_replicate", "rep").replace("dp_shard", "shard")  # HSDP's
            label = short.replace(",", "\n") + ("\nminddp" if impl == "manual" else "\nstock")
            rows.append({"ranks": world_size, "way": label, "mesh": text,
                         "impl": impl, "params": largest[0], "grads": largest[1],
                         "optimizer": largest[2], "activations": largest[3],
                         "formula": formula, "sent": sent})
    return rows


HEADERS = ["ranks", "mesh", "impl", "params MB", "grads MB", "optimizer MB",
           "formula P/G/O MB", "activations MB", "sent per step, largest rank (MB)"]


def table_row(r):
    sent = " ".join(f"{d} {mb:.3f}" for d, mb in r["sent"].items() if mb) or "-"
    return [r["ranks"], r["mesh"], "minddp" if r["impl"] == "manual" else "stock",
            *(f"{r[k]:.3f}" for k in ("params", "grads", "optimizer")),
            "/".join(f"{v:.3f}" for v in r["formula"]), f"{r['activations']:.3f}", sent]


def main(args):
    rows = collect_rows(args, mesh_size)
    if rows is None:
        return  # a rank other than 0, under torchrun
    print(machine(args))
    print(tabulate([table_row(r) for r in rows], headers=HEADERS, tablefmt=args.format,
                   disable_numparse=True))
    if args.png:
        draw_held_and_activations(
            rows, args.png, machine(args),
            title=f"What each rank holds on each mesh: a GPT of {SIZES['blocks']} blocks"
                  f" (width {SIZES['d']}), AdamW, batch {args.batch} x {SIZES['tokens']}"
                  " tokens per dp rank",
            caption="Largest rank. Each mesh twice: minddp's composition, then stock's (the"
                    " same bars: the same tensors held).")
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main(ARGS)
