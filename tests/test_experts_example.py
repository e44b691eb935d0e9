"""Expert parallelism as a user meets it: the example, the break-it, the benchmark, the refusals.

    pytest tests/test_experts_example.py

examples/experts.py's main() on the shared spawns (2 ranks: top-1 and top-2 with a
capacity; 4 ranks: ep=4 and dp=2 x ep=2), --ep manual and --ep reference each writing its
gradient table: `minddp diff` calls each pair IDENTICAL, and the losses and the pairs per
expert printed are the same; one torchrun launch runs the script to its clean exit.
examples/break_experts.py's breaks on the 2-rank spawn: each parts from one process at
step 0, and the diff tool names the expert gradients left W times too large. ep-bench's
measurement at 2 ranks: the bytes to all_to_all and the parameters held equal the formulas.
"""

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile

import pytest
import torch

from ahead import ahead
from helpers import (REPO, assert_identical_tables, load_script, printed_by_main, run,
                     share_spawn, shared_results, torchrun)
from minddp import UsageError
from minddp.launch.start import DDPEnv

SCRIPT = REPO / "examples" / "experts.py"
BREAK = REPO / "examples" / "break_experts.py"
TABLES = os.path.join(tempfile.gettempdir(), f"minddp-experts-{os.getpid()}")  # by rank 0
RUNS = {2: ["", "--top-k 2 --capacity-factor 1.25"], 4: ["--experts 8", "--dp 2 --top-k 2"]}


def _table(tables, world_size, flags, ep):
    return os.path.join(tables, f"{world_size}{flags.replace(' ', '')}-{ep}.txt")


def _train(rank, world_size, tables):
    """Each run of this world size, --ep manual and reference: the lines each rank printed."""
    example = load_script(SCRIPT)
    env = DDPEnv(rank, rank, world_size, "gloo", torch.device("cpu"), 120)
    os.makedirs(tables, exist_ok=True)
    printed = {}
    for flags in RUNS[world_size]:
        for ep in ("manual", "reference"):
            argv = [*flags.split(), "--ep", ep, "--grad-table",
                    _table(tables, world_size, flags, ep)]
            printed[flags, ep] = printed_by_main(example, env, argv, world_size)
    return printed


share_spawn(_train, [2, 4], TABLES)


# to the session's end: this module's tests that read a shared spawn run last (conftest)
@pytest.fixture(scope="session", autouse=True)
def _clean_tables():
    yield
    shutil.rmtree(TABLES, ignore_errors=True)


@pytest.mark.parametrize("world_size, flags", [(w, f) for w, fs in RUNS.items() for f in fs])
def test_the_examples_tables_are_identical_to_one_process(world_size, flags):
    printed = shared_results(_train, world_size)
    assert_identical_tables(_table(TABLES, world_size, flags, "manual"),
                            _table(TABLES, world_size, flags, "reference"), world_size)
    for rank, lines in enumerate(printed):
        steps = [[line for line in lines[flags, ep] if "| loss" in line]
                 for ep in ("manual", "reference")]
        assert steps[0] == steps[1] and len(steps[0]) == 3, rank  # losses, pairs per expert


def test_each_rank_holds_its_experts():
    firsts = [lines["--dp 2 --top-k 2", "manual"][0] for lines in shared_results(_train, 4)]
    assert firsts == ["[rank0] dp 0, ep 0: experts 0 1 of each layer",
                      "[rank1] dp 0, ep 1: experts 2 3 of each layer",
                      "[rank2] dp 1, ep 0: experts 0 1 of each layer",
                      "[rank3] dp 1, ep 1: experts 2 3 of each layer"]


UNDER_TORCHRUN = ahead(lambda tmp: torchrun(2, SCRIPT, "--grad-table", tmp / "ep.txt"))


def test_the_script_under_torchrun_trains_and_exits_cleanly():
    result, tmp_path = UNDER_TORCHRUN.result(), UNDER_TORCHRUN.tmp
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank1] dp 0, ep 1: experts 2 3 of each layer" in result.stdout
    assert "[rank0] step 3/3 | loss " in result.stdout
    assert "outlived" not in result.stdout and (tmp_path / "ep.txt.npz").exists()


@pytest.mark.parametrize("argv, world_size, message", [
    (["--dp", "3"], 4, "--dp 3 does not divide the 4 ranks"),
    (["--experts", "6"], 4, "--experts 6 do not split over ep=4 ranks"),
    (["--top-k", "5"], 2, "--top-k 5 with 4 experts"),
    (["--capacity-factor", "0"], 2, "--capacity-factor 0: no expert could take a token"),
])
def test_a_run_that_cannot_place_its_experts_is_one_line(argv, world_size, message):
    example = load_script(SCRIPT)
    with pytest.raises(UsageError) as error:
        example.checked(example.parser().parse_args(argv), world_size)
    assert error.value.message == message and error.value.same_on_every_rank


def _breaks(rank, world_size, tables):
    """examples/break_experts.py's run() under each break: every rank's verdict."""
    from minddp.mesh.device_mesh import init_device_mesh
    script = load_script(BREAK)
    os.makedirs(tables, exist_ok=True)
    script.args = argparse.Namespace(grad_table=os.path.join(tables, "break.txt"))
    env = DDPEnv(rank, rank, world_size, "gloo", torch.device("cpu"), 120)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    verdicts = {}
    for broken in script.BREAKS:
        script.broken = broken
        script.patch(broken)
        with contextlib.redirect_stdout(io.StringIO()):
            verdicts[broken] = script.run(env, mesh)
        script.patch("none")
    return verdicts


share_spawn(_breaks, [2], TABLES)


def test_the_breaks_show_their_damage():
    for rank, verdicts in enumerate(shared_results(_breaks, 2)):
        assert verdicts["none"] == ("every loss and weight equal to one process's after 3"
                                    " steps, bit for bit"), rank
        for broken in ("no-weights", "unsorted"):
            assert verdicts[broken].startswith("parts from one process at step 0: loss off by"
                                               ), verdicts[broken]
            assert "loss off by 0 " not in verdicts[broken]
        # the experts' gradients alone are off: the loss of step 0 is still one process's
        assert verdicts["summed"].startswith("parts from one process at step 0: loss off by 0"
                                             " on rank"), verdicts["summed"]
        assert ".mlp.experts.mlps." in verdicts["summed"]
    summed = run([sys.executable, "-m", "minddp", "diff",
                  os.path.join(TABLES, "break-summed-minddp.txt"),
                  os.path.join(TABLES, "break-summed-reference.txt")])
    assert "2.000x: at step 0 A's gradients are 2.000 times B's for " in summed.stdout
    assert "a sum not divided by world size?" in summed.stdout, summed.stdout
    unsorted = run([sys.executable, "-m", "minddp", "diff",
                    os.path.join(TABLES, "break-unsorted-minddp.txt"),
                    os.path.join(TABLES, "break-unsorted-reference.txt")])
    assert "the runs part at step 0" in unsorted.stdout and "verdict: DIFFERENT" in \
        unsorted.stdout, unsorted.stdout


def _bench(rank, world_size):
    from minddp.bench.experts import ep_size
    args = argparse.Namespace(batch=2, load_steps=3, rounds=1, warmup=0)
    return ep_size("moe", args, rank, world_size, torch.device("cpu"))


share_spawn(_bench, [2])


def test_ep_bench_measures_the_formulas(tmp_path):
    rows = shared_results(_bench, 2)[0]
    sent = next(r for r in rows if r["table"] == "sent")
    for rank in sent["per_rank"]:
        assert rank["sent"] == rank["formula"], rank
    assert sent["held"] == sent["held_formula"] < sent["whole"]
    loads = {r["weight"]: r["loads"] for r in rows if r["table"] == "load"}
    assert set(loads) == {0.0, 0.01, 0.1}
    for per_step in loads.values():  # every pair of both ranks counted, each step
        assert all(sum(step) == 2 * 2 * 16 for step in per_step), per_step
    from minddp.bench.experts import draw
    drawn = draw(rows, tmp_path / "ep.png", "test")
    assert drawn == {w: [max(s) / (sum(s) / len(s)) for s in loads[w]] for w in loads}
    assert (tmp_path / "ep.png").stat().st_size > 0
