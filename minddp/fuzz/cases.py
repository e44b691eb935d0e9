"""What the fuzzer draws: a model and a mesh, from one seed; and whether the lessons take them.

    minddp fuzz --case 1234 --ranks 4        # one drawn case again, from its seed

A case is drawn from random.Random(seed) alone, so its seed is the whole of it: the command
that reproduces it is printed beside any difference. It draws what a user of the capstone
sets: the GPT's vocabulary, width, heads, blocks and tokens (sizes the mesh does not divide
included), tied or not, dropout, --clip, the recomputation policy, sequence parallel, and a
mesh of at most --ranks ranks (dp x tp x pp, fully_shard or DDP along dp), with the invariant
mode's shards and chunks. `refusal(case)` asks the lessons' own checks (mesh/plan.py,
invariant/plan.py), as examples/gpt_nd.py does before any group: a case they refuse counts
as refused, never as a pass.
"""

import argparse
import dataclasses
import random

from ..invariant.plan import check_invariant
from ..launch.usage_error import UsageError
from ..mesh.plan import check_fits


@dataclasses.dataclass
class Case:
    seed: int
    vocab: int
    d: int
    heads: int
    blocks: int
    tokens: int
    tied: bool
    dropout: float
    clip: float
    recompute: str
    sequence_parallel: bool
    dp: int
    tp: int
    pp: int
    dp_kind: str
    shards: int
    chunks: int
    batch: int

    @property
    def world_size(self):
        return self.dp * self.tp * self.pp

    def mesh(self):
        """The mesh as --mesh writes it (outermost first; size-1 dimensions left out)."""
        dims = [f"{n}={s}" for n, s in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
                if s > 1]
        return ",".join(dims) or "dp=1"

    def describe(self):
        on = [w for w, flag in (("tied", self.tied), ("sp", self.sequence_parallel),
                                (f"clip {self.clip}", self.clip),
                                (f"dropout {self.dropout}", self.dropout),
                                (f"recompute {self.recompute}", self.recompute != "none"))
              if flag]
        return (f"{self.mesh()} {self.dp_kind} | vocab {self.vocab} d {self.d} heads"
                f" {self.heads} blocks {self.blocks} tokens {self.tokens} | shards"
                f" {self.shards} chunks {self.chunks} batch {self.batch}"
                + (f" | {' '.join(on)}" if on else ""))


def draw(seed, max_ranks):
    """The case of this seed, on a mesh of at most max_ranks ranks."""
    rng = random.Random(seed)
    # Mostly what the mode takes, now and then what it must refuse (a 3, a 6): a run of
    # refusals alone would prove nothing of the bits.
    heads = rng.choice([1, 2, 4, 4, 8, 3, 6])
    shape = rng.choice([(dp, tp, pp) for dp in (1, 2, 4, 2, 3) for tp in (1, 2, 4, 2, 3)
                        for pp in (1, 2, 3) if 1 < dp * tp * pp <= max_ranks])
    return Case(seed=seed, vocab=rng.randint(5, 40), d=heads * rng.choice([2, 4]),
                heads=heads, blocks=rng.randint(1, 4), tokens=rng.choice([4, 8, 8, 16, 16, 6]),
                tied=rng.random() < 0.3, dropout=rng.choice([0.0, 0.0, 0.1]),
                clip=rng.choice([None, None, 0.1, 1.0]),
                recompute=rng.choice(["none", "none", "full", "selective"]),
                sequence_parallel=rng.random() < 0.5, dp=shape[0], tp=shape[1], pp=shape[2],
                dp_kind=rng.choice(["fsdp", "ddp"]), shards=rng.choice([4, 8, 8, 16]),
                chunks=rng.choice([c for c in (1, 2, 2, 4) if c >= shape[1]] or [4]),
                batch=rng.choice([8, 16]))


def refusal(case):
    """The one line a lesson refuses this case with, or None if every check takes it."""
    names = tuple(n for n, s in (("pp", case.pp), ("dp", case.dp), ("tp", case.tp)) if s > 1)
    shape = tuple(getattr(case, n) for n in names)
    flags = argparse.Namespace(impl="manual", mesh=case.mesh(), shards=case.shards,
                               chunks=case.chunks, batch=case.batch)
    sizes = {"heads": case.heads, "d": case.d, "tokens": case.tokens}
    try:
        check_fits(shape or (1,), names or ("dp",), case.world_size, heads=case.heads,
                   blocks=case.blocks, tied=case.tied, dp=None)
        check_invariant(flags, sizes, dict(zip(names, shape)))
    except UsageError as refused:
        return str(refused).splitlines()[0]
    return None
