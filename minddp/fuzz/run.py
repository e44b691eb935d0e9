"""Drawn cases run: each on its mesh and in one process, in invariant mode; the tables compared.

    minddp fuzz --ranks 4 --cases 16

The cases of one world size run one after another in one group of ranks started here (gloo,
warm from the benchmarks' fork server); their references, in one process, in another. Each
case trains STEPS AdamW steps and writes its gradient table (every whole gradient, every
step); the two tables are compared as whole gradients (tools/across.py). A rank that raises
ends its group: the case is reported with the error, and the cases after it run in a new one.
"""

import contextlib
import datetime
import io
import os
import random
import traceback

import torch
import torch.distributed as dist

from ..bench.harness import spawn
from ..bench.transformer import gpt
from ..invariant.step import InvariantTraining
from ..launch.teardown import ddp_teardown
from ..memory.recompute import POLICIES
from ..references.libraries import LIBRARIES
from ..tools.gradtable import GradTable
from . import planted

STEPS = 3


def train(case, table, reference):
    """STEPS steps of `case` on its mesh (reference: in one process): its table written."""
    names = [n for n in ("pp", "dp", "tp") if getattr(case, n) > 1 and not reference]
    shape = tuple(getattr(case, n) for n in names)
    mesh = LIBRARIES["manual"].init_device_mesh("cpu", shape or (1,),
                                                mesh_dim_names=tuple(names) or ("dp",))
    torch.manual_seed(case.seed)
    model = gpt(vocab=case.vocab, d=case.d, heads=case.heads, blocks=case.blocks,
                tokens=case.tokens, tied=case.tied)
    training = InvariantTraining(
        model, mesh, dp=case.dp_kind, fully_shard=LIBRARIES["manual"].fully_shard,
        shards=case.shards, chunks=case.chunks, batch=case.batch, seed=case.seed,
        sequence_parallel=case.sequence_parallel, dropout=case.dropout,
        recompute=POLICIES[case.recompute])
    optimizer = torch.optim.AdamW(training.stage.parameters(), lr=1e-2, foreach=False)
    grad_table = GradTable(model, table)
    g = torch.Generator().manual_seed(case.seed)
    for step in range(STEPS):
        tokens = torch.randint(0, case.vocab, (case.batch, case.tokens + 1), generator=g)
        optimizer.zero_grad()
        _, whole = training.step(step, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        grad_table.record()
        if case.clip is not None:
            training.clip_grad_norm_(whole, case.clip)
        optimizer.step()
    grad_table.save()


def _ranks(rank, world_size, cases, reference, plant, store, folder):
    """One group's rank: its cases in turn, a marker file as each one ends."""
    # A minute for a collective: a case whose ranks wait for each other forever is a finding,
    # reported, not a fuzzer that hangs.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    planted.plant(plant)
    for case in cases:
        where = os.path.join(folder, f"{case.seed}-{'one' if reference else 'mesh'}")
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # (the table's own line)
                train(case, where + ".txt", reference)
        except Exception:
            with open(f"{where}.error{rank}", "w") as f:
                f.write(traceback.format_exc())
            raise  # the group is not to be trusted after a rank's error: a new one goes on
        if rank == 0:
            open(where + ".done", "w").close()
    ddp_teardown()


def run_group(cases, reference, plant, folder):
    """Run `cases` (of one world size) until all are done; the errors of those that raised."""
    errors = {}
    while cases:
        world_size = 1 if reference else cases[0].world_size
        store = os.path.join(folder, f"store-{random.getrandbits(64)}")
        failure = "the group ended"
        try:
            spawn(_ranks, (world_size, cases, reference, plant, store, folder), world_size)
        except Exception as ended:  # read back below: which case did not finish
            failure = str(ended).strip().splitlines()[-1]
        tag = "one" if reference else "mesh"
        done = [c for c in cases if os.path.exists(os.path.join(folder, f"{c.seed}-{tag}.done"))]
        if len(done) == len(cases):
            break
        broken = cases[len(done)]
        said = [open(os.path.join(folder, n)).read() for n in sorted(os.listdir(folder))
                if n.startswith(f"{broken.seed}-{tag}.error")]
        errors[broken.seed] = said[0].strip().splitlines()[-1] if said else failure
        cases = cases[len(done) + 1:]
    return errors
