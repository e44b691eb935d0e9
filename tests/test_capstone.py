"""The capstone example (examples/gpt_nd.py): a small GPT on a 2-D and a 3-D mesh, minddp's
composition against stock's, gradient tables IDENTICAL; and the mesh refused before any group.

    pytest tests/test_capstone.py

The example's main() runs on the suite's shared spawns (2 ranks: dp=2, tp=2 and pp=2 with
--recompute and dropout; 4 ranks: --mesh dp=2,tp=2 with fully_shard and with DDP,
pp=2,dp=2, HSDP's dp_replicate=2,dp_shard=2 and dp_replicate=2,dp_shard=1,tp=2; 8 ranks:
pp=2,dp=2,tp=2), with --impl manual and stock,
each writing its gradient table; `minddp diff` must call each pair IDENTICAL. One torchrun
launch (2 ranks, --mesh tp=2) runs the script as a user does, to its clean exit.
"""

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
import torch

from ahead import ahead, ahead_run
from helpers import (REPO, assert_identical_tables, load_script, printed_by_main, run,
                     share_spawn, shared_results, torchrun)
from minddp import UsageError
from minddp.launch.start import DDPEnv
from minddp.mesh.plan import check_fits, parse_mesh
from minddp.tools.tables import read_table

SCRIPT = REPO / "examples" / "gpt_nd.py"
TABLES = os.path.join(tempfile.gettempdir(), f"minddp-gpt-nd-{os.getpid()}")  # made by rank 0
# world size: the runs, each once with --impl manual and once with --impl stock
MESHES = {2: ["--mesh dp=2 --dropout 0.1", "--mesh dp=2 --dropout 0.1 --recompute selective",
              "--mesh tp=2 --dropout 0.1 --recompute full",
              "--mesh pp=2 --untied --dropout 0.1 --recompute selective"],
          4: ["--mesh dp=2,tp=2 --clip 0.1", "--mesh dp=2,tp=2 --dp ddp",
              "--mesh pp=2,dp=2 --untied --clip 0.1", "--mesh dp_replicate=2,dp_shard=2 --clip 0.1",
              "--mesh dp_replicate=2,dp_shard=1,tp=2 --clip 0.1"],
          8: ["--mesh pp=2,dp=2,tp=2 --untied --clip 0.1"]}


def _table(tables, flags, impl):
    return os.path.join(tables, f"{flags.replace(' ', '').replace(',', '_')}-{impl}.txt")


def _train(rank, world_size, tables):
    """Every mesh of this world size, both implementations: the lines each rank printed."""
    example = load_script(SCRIPT)
    env = DDPEnv(rank, rank, world_size, "gloo", torch.device("cpu"), 120)
    os.makedirs(tables, exist_ok=True)
    printed = {}
    for flags in MESHES[world_size]:
        for impl in ("manual", "stock"):
            argv = [*flags.split(), "--impl", impl, "--grad-table", _table(tables, flags, impl)]
            printed[flags, impl] = printed_by_main(example, env, argv, world_size)
    return printed


share_spawn(_train, [2, 4, 8], TABLES)


def _what_stock_does(rank, world_size):
    """Stock's own clip_grad_norm_ on FSDP over TP, and DDP over TP's parameters in forward."""
    import torch.nn.functional as F
    from minddp.bench.transformer import gpt
    from minddp.mesh.compose import parallelize
    from minddp.references.libraries import LIBRARIES
    seen = {}
    for dp in ("fsdp", "ddp"):
        lib = LIBRARIES["stock"]
        mesh = lib.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = gpt()
        stage = parallelize(model, mesh, lib, dp)
        before = len(list(stage.parameters()))
        x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
        F.cross_entropy(stage(x).flatten(0, 1), x.flatten()).backward()
        seen[dp, "parameters before, after a forward"] = (before, len(list(stage.parameters())))
        if dp == "fsdp":
            try:
                torch.nn.utils.clip_grad_norm_(stage.parameters(), 0.1)
                seen["clip"] = "ran"
            except RuntimeError as error:
                seen["clip"] = str(error)
    return seen


share_spawn(_what_stock_does, [4])


def test_stocks_own_clip_refuses_fsdp_over_tp_and_ddp_over_tp_hides_its_tp_weights():
    for rank, seen in enumerate(shared_results(_what_stock_does, 4)):
        # why clip.py and libraries.py take the norm per mesh, as torchtitan does
        assert "All operands in aten.stack.default must have the same mesh" in seen["clip"]
        assert seen["fsdp", "parameters before, after a forward"] == (36, 36), rank
        # the 2 blocks' 12 TP weights each leave DDP's module.parameters() in forward
        assert seen["ddp", "parameters before, after a forward"] == (36, 12), rank


def test_clip_with_ddp_over_tp_is_refused_in_one_line():
    example = load_script(SCRIPT)
    args = example.parser().parse_args(["--mesh", "dp=2,tp=2", "--dp", "ddp", "--clip", "1"])
    with pytest.raises(UsageError, match="^--clip with --dp ddp and tp: stock's DDP over TP"):
        example.checked(args, 4)


def test_recomputation_changes_no_number():
    # --recompute selective against none, both minddp's, dropout on: the same table (the
    # checkpoint keeps the blocks' parameter names; the masks are drawn again the same)
    shared_results(_train, 2)
    verdict = run([sys.executable, "-m", "minddp", "diff",
                   _table(TABLES, "--mesh dp=2 --dropout 0.1 --recompute selective", "manual"),
                   _table(TABLES, "--mesh dp=2 --dropout 0.1", "manual")])
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout


# to the session's end: this module's tests that read a shared spawn run last (conftest)
@pytest.fixture(scope="session", autouse=True)
def _clean_tables():
    yield
    shutil.rmtree(TABLES, ignore_errors=True)


@pytest.mark.parametrize("world_size, flags", [(w, f) for w, fs in MESHES.items() for f in fs])
def test_the_capstones_tables_are_identical_to_stocks(world_size, flags):
    printed = shared_results(_train, world_size)
    assert_identical_tables(_table(TABLES, flags, "manual"), _table(TABLES, flags, "stock"),
                            world_size)
    for rank, lines in enumerate(printed):
        # the same losses and the same holdings, line for line, on every rank
        assert lines[flags, "manual"] == lines[flags, "stock"], f"rank {rank}"
        assert lines[flags, "manual"][0].startswith(f"[rank{rank}] mesh (")


def test_each_rank_holds_its_share_of_the_weights():
    printed = shared_results(_train, 8)
    # pp=2, dp=2, tp=2: stage 0 (embedding, block 0) and stage 1 (block 1, head), each
    # block's Linear layers halved over tp, everything halved again over dp.
    firsts = {lines["--mesh pp=2,dp=2,tp=2 --untied --clip 0.1", "manual"][0] for lines in printed}
    assert {line.split("] ", 1)[1].split(": ", 1)[1] for line in firsts} == {
        "layers 0-1 of 4, holds 1164 of 7744 weight elements (15.0%)",
        "layers 2-3 of 4, holds 1116 of 7744 weight elements (14.4%)"}
    assert "[rank5] mesh (pp 1/2, dp 0/2, tp 1/2): layers 2-3" in "".join(firsts)


def test_an_hsdp_rank_holds_its_shard_share_and_names_its_replicas():
    printed = shared_results(_train, 4)
    flags = "--mesh dp_replicate=2,dp_shard=2 --clip 0.1"
    firsts = [lines[flags, "manual"][0] for lines in printed]
    # every weight cut in two over dp_shard; ranks 0 and 2 (1 and 3) hold the same rows
    assert firsts[2] == "[rank2] mesh (dp_replicate 1/2, dp_shard 0/2): layers 0-3 of 4, holds" \
        " 3616 of 7232 weight elements (50.0%), the same shards as ranks [0, 2]", firsts
    assert firsts[1].endswith("(50.0%), the same shards as ranks [1, 3]"), firsts


@pytest.mark.parametrize("world_size, flags", [(w, f) for w, fs in MESHES.items() for f in fs
                                               if "--clip" in f])
def test_the_clipped_norm_is_the_whole_models_gradient_norm(world_size, flags):
    """--clip's norm, printed on each dp rank's line, is the 2-norm of the whole model's
    gradient, the one the gradient table holds."""
    printed = shared_results(_train, world_size)
    meta, grads = read_table(_table(TABLES, flags, "manual"))
    norms = {}
    for rank, lines in enumerate(printed):
        for line in lines[flags, "manual"]:
            if "grad norm" in line:  # this dp rank's: its batches
                step = int(line.split("step ")[1].split("/")[0]) - 1
                norms[rank, step] = float(line.rsplit(" ", 1)[1])
    assert norms and len({s for _, s in norms}) == 3, printed[0][flags, "manual"]
    for (rank, step), norm in norms.items():
        # every rank's table row holds whole gradients (averaged over dp, gathered over dp
        # and tp); with pp, a stage's own: another stage's weights are NaN on this rank
        squares = 0.0
        for name, g in grads.items():
            holder = next(r for r in range(world_size) if not np.isnan(g[step, r]).any())
            squares += float((g[step, holder].astype(np.float64) ** 2).sum())
        assert norm == pytest.approx(squares ** 0.5, rel=1e-5), (rank, step)
        assert norm > 0.1  # so the clip scaled every gradient


UNDER_TORCHRUN = ahead(lambda tmp: torchrun(2, SCRIPT, "--mesh", "tp=2", "--grad-table",
                                             tmp / "tp.txt"))


def test_the_script_under_torchrun_trains_and_exits_cleanly():
    result, tmp_path = UNDER_TORCHRUN.result(), UNDER_TORCHRUN.tmp
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank0] mesh (tp 0/2): layers 0-3 of 4" in result.stdout
    assert "[rank0] step 3/3 | loss " in result.stdout
    assert "outlived" not in result.stdout and (tmp_path / "tp.txt.npz").exists()


MESH_TOO_BIG = ahead_run([sys.executable, str(SCRIPT), "--mesh", "dp=2,tp=2"])  # a world of one


def test_a_mesh_that_does_not_fit_is_refused_before_torch_loads():
    result = MESH_TOO_BIG.result()
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == \
        "error: --mesh dp=2,tp=2 holds 4 ranks, but the world has 1", result.stderr


@pytest.mark.parametrize("mesh, world_size, extra, message", [
    ("dp=2,tp=3", 6, {}, "--mesh dp=2,tp=3: tp=3 does not divide the 4 attention heads"),
    ("pp=3", 3, {"tied": False}, "--mesh pp=3: 3 pipeline stages for 2 blocks"),
    ("pp=2,dp=2", 4, {}, "--mesh pp=2,dp=2: a tied embedding cannot be split over pipeline"
                         " stages"),
    ("pp=2,dp=2", 4, {"tied": False, "dp": "ddp"}, "--mesh pp=2,dp=2 --dp ddp: minddp's"
     " pipeline runs fully_shard-ed stages, not DDP-wrapped ones"),
    ("dp=2,tp=2", 8, {}, "--mesh dp=2,tp=2 holds 4 ranks, but the world has 8"),
    ("dp_replicate=2,dp_shard=2", 4, {"dp": "ddp"}, "--mesh dp_replicate=2,dp_shard=2 --dp"
     " ddp: dp_replicate and dp_shard are fully_shard's (HSDP)"),
])
def test_what_the_mesh_asks_of_the_model_is_one_line(mesh, world_size, extra, message):
    shape, names = parse_mesh(mesh)
    with pytest.raises(UsageError) as error:
        check_fits(shape, names, world_size, **{"heads": 4, "blocks": 2, "tied": True, **extra})
    assert error.value.message == message and error.value.same_on_every_rank


@pytest.mark.parametrize("text, message", [
    ("tp=2,dp=2", "--mesh tp=2,dp=2: dimensions go outermost first, dp, tp"),
    ("ep=2", "--mesh ep=2: dimension 'ep' is not one of pp, dp, dp_replicate, dp_shard, tp"),
    ("dp=two", "--mesh dp=two: dp=two is not a count of ranks"),
    ("dp=2,dp=2", "--mesh dp=2,dp=2: dp appears twice"),
    ("dp_shard=2,dp_replicate=2", "--mesh dp_shard=2,dp_replicate=2: dimensions go outermost"
     " first, dp_replicate, dp_shard"),
    ("dp=2,dp_shard=2", "--mesh dp=2,dp_shard=2: dp with dp_replicate or dp_shard"),
    ("dp_replicate=2,tp=2", "--mesh dp_replicate=2,tp=2: dp_replicate without dp_shard"),
])
def test_a_mesh_flag_that_does_not_parse_is_one_line(text, message):
    with pytest.raises(UsageError) as error:
        parse_mesh(text)
    assert error.value.message == message
    assert parse_mesh("pp=2,dp=1,tp=4") == ((2, 1, 4), ("pp", "dp", "tp"))
    assert parse_mesh("pp=2,dp_replicate=2,dp_shard=1,tp=2") == (
        (2, 2, 1, 2), ("pp", "dp_replicate", "dp_shard", "tp"))
