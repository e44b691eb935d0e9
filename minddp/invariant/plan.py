"""What the invariant mode asks of a mesh and a model, checked before any process group.

    python examples/gpt_nd.py --invariant --mesh dp=3      # one line: dp=3 is not a power of two

Every sum the mesh splits is a pairwise tree over a fixed number of leaves (tree.py), so the
leaves and the ranks that share them come in powers of two: V shards that dp divides, C
chunks that tp divides and that the heads, the MLP's hidden units and the tokens divide.
"""

from ..launch.usage_error import UsageError
from .tree import is_power_of_two


def _refuse(message, hint):
    raise UsageError(message, hint=hint, same_on_every_rank=True)


def check_invariant(args, sizes, dims):
    """Refuse, in one line, what --invariant cannot give one order (every rank the same)."""
    if args.impl != "manual":
        _refuse("--invariant with --impl stock: stock has no invariant mode",
                "drop --impl stock (the invariant mode is minddp's own)")
    for name in ("dp", "dp_replicate", "dp_shard", "tp"):
        if not is_power_of_two(dims.get(name, 1)):
            _refuse(f"--invariant --mesh {args.mesh}: {name}={dims[name]} is not a power of"
                    " two", f"a pairwise tree is shared by 1, 2, 4, ... ranks: pick such a"
                    f" {name}")
    shards, chunks = args.shards, args.chunks
    dp = dims.get("dp", 1) * dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
    if not is_power_of_two(shards) or shards % dp or args.batch % shards:
        _refuse(f"--shards {shards} with --batch {args.batch} and dp={dp}",
                "shards: a power of two that dp divides and that divides --batch")
    if shards // dp < dims.get("pp", 1):
        _refuse(f"--shards {shards} at dp={dp}: {shards // dp} microbatches for"
                f" {dims['pp']} pipeline stages", "1F1B needs a microbatch a stage: more"
                " --shards")
    widths = {"heads": sizes["heads"], "hidden units": 4 * sizes["d"],
              "tokens": sizes["tokens"]}
    bad = [name for name, n in widths.items() if n % chunks]
    if not is_power_of_two(chunks) or chunks % dims.get("tp", 1) or bad:
        _refuse(f"--chunks {chunks} at tp={dims.get('tp', 1)}"
                + (f": the {bad[0]} ({widths[bad[0]]}) do not split into {chunks}" if bad
                   else ""), "chunks: a power of two that tp divides and that divides the"
                " heads, the MLP's hidden units and the tokens")
