"""Break the invariant mode and see: one fixed order turned off, which meshes part from one process.

    python examples/break_invariant.py --break all          # each break in turn
    python examples/break_invariant.py --break dp-ring      # gloo's ring over dp: 4 ranks part
    python examples/break_invariant.py --break chunks clip  # two of them

The small GPT of examples/gpt_nd.py trains 3 SGD steps in invariant mode (sequence parallel,
--clip 0.1, dropout 0.1) in one process and on every mesh of 2 and 4 ranks, ranks started
here (gloo), with one of minddp/invariant/'s orders patched back to the normal mode's (the
library itself stays unbroken). Each mesh's whole gradients are compared with the one
process's (minddp diff, tools/across.py): IDENTICAL, or where they first part and by how
many units in the last place. docs/invariant.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "every order fixed",
    "shard-order": "each rank adds its shards' gradients one after another, as .grad does",
    "dp-ring": "the sum over dp by gloo's all_reduce (its ring), not the tree",
    "chunks": "tp cuts the split dimensions: one chunk per tp rank, as tensor parallelism",
    "tokens": "the LayerNorms' gradients summed over a rank's tokens at once",
    "clip": "the clip's norm from each rank's part, summed over the mesh (mesh/clip.py)",
    "dropout": "dropout's masks from each rank's global generator",
}
MESHES = {1: ["dp=1"], 2: ["dp=2", "tp=2", "pp=2"], 4: ["dp=4", "dp=2,tp=2", "pp=2,tp=2"]}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", nargs="+", default=["all"],
                        choices=[*BREAKS, "all"], help="one or more, or all")
    args = parser.parse_args()

import contextlib
import io
import os
import tempfile

import torch
import torch.distributed as dist
from tabulate import tabulate

import minddp.invariant.chunks as chunks
import minddp.invariant.shards as shards
import minddp.invariant.step as step
from minddp import exit_on_failure, exit_on_usage_error
from minddp.bench.harness import spawn
from minddp.bench.transformer import gpt
from minddp.invariant.tree import fold
from minddp.launch.teardown import ddp_teardown
from minddp.mesh.plan import parse_mesh
from minddp.references.libraries import LIBRARIES
from minddp.tools.across import compare_whole
from minddp.tools.diff import ulp_distance
from minddp.tools.gradtable import GradTable
from minddp.tools.tables import read_table

SIZES = dict(vocab=32, d=16, heads=4, tokens=8)


class RunningSum:  # "shard-order": the tree's Folder, as .grad accumulates
    def __init__(self):
        self.sum = None

    def add(self, leaf):
        self.sum = leaf if self.sum is None else self.sum + leaf

    def total(self):
        total, self.sum = self.sum, None
        return total


def ring_sum(parts, group=None):  # "dp-ring": the tree on the rank, gloo's ring over ranks
    total = fold(list(parts)).clone()
    for one in group if isinstance(group, (list, tuple)) else [group]:  # HSDP's: a list
        if one is not None:
            dist.all_reduce(total, group=one)
    return total


def mesh_clip(training, mesh):  # "clip": the normal mode's clip
    return lambda whole, max_norm: LIBRARIES["manual"].clip_grad_norm_(training.stage,
                                                                     max_norm, mesh)


def unseeded(self, index):  # "dropout": the masks drawn from wherever the generator is
    return lambda module, args: None


def patch(broken):
    if broken == "shard-order":
        shards.Folder = RunningSum
    elif broken == "dp-ring":
        shards.tree_sum = ring_sum
    elif broken == "chunks":  # as many chunks as tp ranks: each rank's slice in one piece
        whole = step.chunk_block
        step.chunk_block = lambda block, c, group, *rest: whole(
            block, 1 if group is None else dist.get_world_size(group), group, *rest)
    elif broken == "tokens":  # a rank's tokens in one piece
        norm, bias = chunks.layer_norm, chunks.add_bias
        chunks.layer_norm = lambda ln, x, n, group: norm(ln, x, 1, group)
        chunks.add_bias = lambda y, b, n, group: bias(y, b, 1, group)
    elif broken == "dropout":
        shards.ShardDropout.seed_block = unseeded


def train(mesh_text, table):
    """3 steps in invariant mode on this mesh (collective): the gradient table written."""
    shape, names = parse_mesh(mesh_text)
    mesh = LIBRARIES["manual"].init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = gpt(**SIZES, blocks=2, tied=False)
    training = step.InvariantTraining(model, mesh, shards=8, chunks=4, batch=8, seed=0,
                                      fully_shard=LIBRARIES["manual"].fully_shard,
                                      sequence_parallel=True, dropout=0.1)
    clip = mesh_clip(training, mesh) if BROKEN == "clip" else training.clip_grad_norm_
    optimizer = torch.optim.SGD(training.stage.parameters(), lr=0.1, momentum=0.9)
    grad_table = GradTable(model, table)
    for i in range(3):
        tokens = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        _, whole = training.step(i, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        grad_table.record()
        clip(whole, 0.1)
        optimizer.step()
    grad_table.save()


def rank_main(rank, world_size, broken, store, folder):
    global BROKEN
    BROKEN = broken
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)
    patch(broken)
    with contextlib.redirect_stdout(io.StringIO()):  # (the tables' own lines)
        for mesh_text in MESHES[world_size]:
            train(mesh_text, os.path.join(folder, f"{mesh_text}.txt"))
    ddp_teardown()


def run(broken):
    print(f"\nbreak {broken}: {BREAKS[broken]}")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for world_size in MESHES:
            spawn(rank_main, (world_size, broken, os.path.join(folder, f"store{world_size}"),
                              folder), world_size)
        one = read_table(os.path.join(folder, "dp=1.txt"))
        for mesh_text in MESHES[2] + MESHES[4]:
            _, first = compare_whole(*read_table(os.path.join(folder, f"{mesh_text}.txt")),
                                     *one, ulp_distance)
            rows.append([mesh_text, "IDENTICAL" if first is None else "DIFFERENT",
                         "" if first is None else f"step {first[0]}, {first[1]!r},"
                         f" element {list(first[2])}", "" if first is None else first[5]])
    print(tabulate(rows, headers=["mesh", "vs one process", "first difference", "ulps"]))


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        for name in (BREAKS if "all" in args.broken else args.broken):
            run(name)
