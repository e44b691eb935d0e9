"""What a mesh asks of a model, checked before any process group exists (no torch needed).

    python examples/gpt_nd.py --mesh dp=2,tp=3      # one line: tp=3 does not divide 4 heads

`--mesh pp=2,dp=2,tp=2` names the mesh's dimensions, outermost first. Each asks something
of the model: tp must divide the attention heads (each tp rank computes whole heads), pp
stages need a block each, and the product must be the world size. A rank that found out
inside a collective would leave its peers waiting; every rank finds the same answer here,
from the command line alone, before the first group is made.

  parse_mesh   "pp=2,dp=2,tp=2" -> ((2, 2, 2), ("pp", "dp", "tp")), refusals in one line;
               "dp_replicate=2,dp_shard=2" (HSDP) -> ((2, 2), ("dp_replicate", "dp_shard"))
  check_fits   the mesh against the model and the world size, refusals in one line
"""

import math

from ..launch.usage_error import UsageError

# torchtitan's order, outermost first: tp talks most. dp is data parallel over one group of
# ranks; HSDP splits it in two, dp_replicate (across nodes) and dp_shard (within one).
DIMENSIONS = ("pp", "dp", "dp_replicate", "dp_shard", "tp")


def _refuse(message, hint):
    raise UsageError(message, hint=hint, same_on_every_rank=True)


def parse_mesh(text):
    """'pp=2,dp=2,tp=2' -> (shape, names), in the order written; refused in one line."""
    shape, names = [], []
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in DIMENSIONS:
            _refuse(f"--mesh {text}: dimension {name!r} is not one of {', '.join(DIMENSIONS)}",
                    "pp: pipeline stages, dp: data parallel (HSDP's: dp_replicate and"
                    " dp_shard), tp: tensor parallel; e.g. --mesh dp=2,tp=2")
        if not size.strip().isdigit() or int(size) < 1:
            _refuse(f"--mesh {text}: {name}={size or '?'} is not a count of ranks",
                    "each dimension is name=N with N at least 1, e.g. --mesh dp=2,tp=2")
        if name in names:
            _refuse(f"--mesh {text}: {name} appears twice", "name each dimension once")
        shape.append(int(size))
        names.append(name)
    if "dp" in names and ("dp_replicate" in names or "dp_shard" in names):
        _refuse(f"--mesh {text}: dp with dp_replicate or dp_shard", "dp is data parallel"
                " on one dimension; HSDP splits it in two: dp_replicate=R,dp_shard=S instead")
    if "dp_replicate" in names and "dp_shard" not in names:
        _refuse(f"--mesh {text}: dp_replicate without dp_shard", "HSDP shards over dp_shard"
                " (=1 for none); replicas alone are DDP's: --mesh dp=N --dp ddp")
    order = [n for n in DIMENSIONS if n in names]
    if names != order:
        # Stock lays the ranks out in the order given: tp written first would put each tp
        # group's ranks far apart, and fully_shard over TP expects (dp, tp). Said, not guessed.
        _refuse(f"--mesh {text}: dimensions go outermost first, {', '.join(order)}",
                f"write --mesh {','.join(f'{n}={shape[names.index(n)]}' for n in order)}"
                " (tp innermost: it talks at every layer, so its ranks are neighbours)")
    return tuple(shape), tuple(names)


def check_fits(shape, names, world_size, *, heads, blocks, tied, dp="fsdp"):
    """Refuse, in one line, a mesh this model or this world cannot run (before any group)."""
    size = dict(zip(names, shape))
    described = ",".join(f"{n}={s}" for n, s in size.items())
    if math.prod(shape) != world_size:
        _refuse(f"--mesh {described} holds {math.prod(shape)} ranks, but the world has"
                f" {world_size}", f"start {math.prod(shape)} ranks (torchrun"
                f" --nproc_per_node={math.prod(shape)}) or change --mesh")
    if heads % size.get("tp", 1):
        _refuse(f"--mesh {described}: tp={size['tp']} does not divide the {heads} attention"
                " heads", "each tp rank computes whole heads: use a tp that divides them")
    if size.get("pp", 1) > blocks:
        _refuse(f"--mesh {described}: {size['pp']} pipeline stages for {blocks} blocks",
                f"use pp of at most {blocks} (or more --blocks): each stage needs a block")
    if size.get("pp", 1) > 1 and tied:
        # The embedding sits on the first stage, the output layer on the last: one tensor
        # in two processes. Stock's pipelining has no way to add up its two gradients, and
        # torchtitan refuses weight tying with pipeline parallel for the same reason.
        _refuse(f"--mesh {described}: a tied embedding cannot be split over pipeline stages",
                "pass --untied (the first stage keeps the embedding, the last its own output"
                " layer)")
    if dp == "ddp" and "dp_shard" in size:
        _refuse(f"--mesh {described} --dp ddp: dp_replicate and dp_shard are fully_shard's"
                " (HSDP)", "for DDP write --mesh dp=N --dp ddp")
    if size.get("pp", 1) > 1 and dp == "ddp" and size.get("dp", 1) > 1:
        _refuse(f"--mesh {described} --dp ddp: minddp's pipeline runs fully_shard-ed stages,"
                " not DDP-wrapped ones", "use --dp fsdp (stock decides DDP's sync inside its"
                " reducer, which minddp's schedule cannot reach)")
