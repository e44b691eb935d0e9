"""The benchmark runs and reports what it promises (its figures are in docs/benchmark.md).

    pytest tests/test_bench.py

Not a timing test: speed is measured by `minddp bench`, not asserted here.
"""

import json
import re
import sys

import pytest

from ahead import ahead_run
from helpers import cli, run, share_spawn, shared_results
from minddp.pp.stage import MAX_DIMS


BENCH = ahead_run([sys.executable, "-m", "minddp", "bench", "--sizes", "0.3M", "--world-sizes",
                   "2", "--rounds", "2", "--warmup", "1"])


def test_bench_reports_every_contender_as_a_ratio_to_stock():
    # (a process of its own, as a user runs it: the ranks' progress lines come on its stderr)
    result = BENCH.result()
    assert result.returncode == 0, result.stderr[-3000:]
    # Progress on stderr: what will run, then each case as it is done; stdout: the table.
    said = [line for line in result.stderr.splitlines() if line.startswith("minddp bench: ")]
    assert said[0].startswith("minddp bench: 0.3M at 2 rank(s), 2 round(s) of 1 step(s)"), said
    assert re.fullmatch(r"minddp bench:   0.3M at 2 rank\(s\): done in [\d.]+ s", said[1]), said
    lines = result.stdout.splitlines()
    columns = [len(c) for c in lines[2].split()]  # tabulate's dashes give each column's width
    starts = [sum(columns[:i]) + 2 * i for i in range(len(columns))]
    rows = [[line[a:a + w].strip() for a, w in zip(starts, columns)] for line in lines[3:]]
    by = {r[3]: dict(zip(["ms", "vs", "round", "same", "mb", "calls", "memory"], r[4:]))
          for r in rows}
    assert list(by) == ["no sync", "naive", "bucketed", "stock", "bucketed view", "stock view",
                        "bucketed fp16", "stock fp16"]
    assert by["stock"]["vs"] == "1.00x" and by["stock view"]["same"] == "1.00x"
    assert by["stock"]["round"] == "1.00x (1.00-1.00)"  # each step over itself
    assert all(re.fullmatch(r"[\d.]+x \([\d.]+-[\d.]+\)", r["round"]) for r in by.values())
    # 0.27M float32 parameters: 1.0 MB all-reduced per step, 0.5 MB with the fp16 hook.
    assert [by[c]["mb"] for c in ("naive", "bucketed", "stock", "bucketed view")] == ["1.0"] * 4
    assert by["bucketed fp16"]["mb"] == by["stock fp16"]["mb"] == "0.5"
    assert by["naive"]["calls"] == "10" and by["bucketed"]["calls"] == "1"
    # .grad and buckets: 2 copies of the gradients, 1 with gradient_as_bucket_view.
    assert by["bucketed"]["memory"] == by["stock"]["memory"] == "2.0"
    assert by["bucketed view"]["memory"] == by["stock view"]["memory"] == "1.0"


@pytest.fixture(scope="module")
def fsdp_rows(tmp_path_factory):
    """One small run of python -m minddp.fsdp_bench at 2 ranks: its rows, unrounded."""
    path = tmp_path_factory.mktemp("fsdp") / "rows.json"
    result = cli("fsdp-bench", "--sizes", "0.3M", "--world-sizes",
                 "2", "--rounds", "1", "--warmup", "0", "--json", path,
                 "--png", path.with_suffix(".png"))
    assert result.returncode == 0, result.stderr[-3000:]
    return {r["way"]: r for r in json.load(open(path))["rows"]}, path.with_suffix(".png")


def test_fsdp_bench_measures_what_each_zero_stage_keeps_and_sends(fsdp_rows):
    by = fsdp_rows[0]
    assert list(by) == ["DDP", "ZeRO-1", "FSDP no reshard", "stock no reshard", "FSDP",
                        "stock fully_shard", "FSDP prefetch", "stock prefetch"]
    whole = by["DDP"]["model MB"]  # 0.27M float32 parameters; widths divide by 2: no padding
    assert by["DDP"]["params"] == by["DDP"]["grads"] == by["DDP"]["unsharded"] == whole
    assert by["DDP"]["optimizer"] == pytest.approx(2 * whole, rel=1e-4)  # + AdamW's step counts
    assert by["ZeRO-1"]["optimizer"] == pytest.approx(whole, rel=0.01)  # half of 2 x, per rank
    for ours, stock in (("FSDP", "stock fully_shard"), ("FSDP no reshard", "stock no reshard")):
        for column in ("params", "grads", "optimizer", "unsharded", "passed MB"):
            assert by[ours][column] == by[stock][column], (ours, column)
        assert by[ours]["params"] == by[ours]["grads"] == whole / 2
    # ZeRO-3 holds one layer gathered at a time (the largest: 256 x 256 + 256); kept from
    # forward to backward, every layer is whole at the peak.
    assert by["FSDP"]["unsharded"] == (256 * 256 + 256) * 4 / 2**20
    assert by["FSDP no reshard"]["unsharded"] == whole
    # The ring model: DDP 2 x P (W-1)/W; ZeRO-1 and ZeRO-3 3 x; ZeRO-2-like 2 x.
    sent = {way: round(r["sent / P"], 2) for way, r in by.items()}
    assert sent == {"DDP": 2.0, "ZeRO-1": 3.0, "FSDP no reshard": 2.0, "stock no reshard": 2.0,
                    "FSDP": 3.0, "stock fully_shard": 3.0, "FSDP prefetch": 3.0,
                    "stock prefetch": 3.0}
    assert by["FSDP"]["passed MB"] == {"all_gather": 2 * whole, "reduce_scatter": whole}
    # Prefetching moves the gathers, it sends the same bytes; the next layer is whole early,
    # so more is gathered at the peak; the prefetch thread's time was measured.
    for column in ("params", "grads", "optimizer", "passed MB"):
        assert by["FSDP prefetch"][column] == by["FSDP"][column], column
    assert by["FSDP prefetch"]["unsharded"] > by["FSDP"]["unsharded"]
    gathering, waited = by["FSDP prefetch"]["prefetch ms"]
    assert gathering > 0 and waited >= 0


def test_memory_picture_draws_the_measured_bytes(fsdp_rows, tmp_path):
    import matplotlib.image
    from minddp.tools.pictures import draw_memory
    by, png = fsdp_rows
    assert matplotlib.image.imread(png).shape == (420, 1300, 4)  # the bench drew it, 100 dpi
    drawn = draw_memory(list(by.values()), tmp_path / "again.png", "test")  # read back
    for way, row in by.items():
        bar = drawn[(2, way)]
        assert [bar["params"], bar["grads"], bar["optimizer"]] == \
               [row["params"], row["grads"], row["optimizer"]], way
        # Beyond what a rank holds: FSDP's gathered weights; DDP's and ZeRO-1's are whole anyway.
        assert bar["gathered"] == (0.0 if way in ("DDP", "ZeRO-1") else row["unsharded"]), way


@pytest.mark.parametrize("program", ["fsdp", "timeline"])
def test_png_without_matplotlib_says_what_to_install(program, tmp_path, monkeypatch, capsys):
    import importlib
    module = importlib.import_module(f"minddp.bench.{program}")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(SystemExit) as exited:
        module.parse(["--png", str(tmp_path / "x.png")])  # the flags, checked before any rank
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: --png needs matplotlib, which is not installed" in err
    assert 'pip install -e ".[plot]"' in err and not (tmp_path / "x.png").exists()


def test_tp_bench_counts_what_the_formula_says():
    """One small run of minddp tp-bench at 2 ranks: bytes passed, bytes held, stock beside."""
    result = cli("tp-bench", "--world-sizes", "2", "--rounds",
                 "2", "--warmup", "1", "--batch", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    by_way = {}  # the table's cells are separated by two spaces or more
    for line in result.stdout.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == "2":
            by_way[cells[1]] = cells
    assert set(by_way) == {"DDP", "FSDP", "TP", "TP stock", "TP+SP", "TP+SP stock"}, result.stdout
    for way in ("TP", "TP+SP"):
        passed, formula = by_way[way][6], by_way[way][7]
        assert passed == formula and passed != "-", (way, passed, formula)  # counted = predicted
        assert by_way[way][2:6] == by_way[f"{way} stock"][2:6]  # the same bytes held as stock
    assert float(by_way["TP"][2]) < float(by_way["DDP"][2])  # each rank a slice of the weights
    assert float(by_way["TP+SP"][5]) < float(by_way["TP"][5])  # and of the activations



@pytest.mark.parametrize("command,message", [
    (["bench", "--world-sizes", "0"], "error: argument --world-sizes: must be at least 1, not 0"),
    (["fsdp-bench", "--rounds", "0"], "error: argument --rounds: must be at least 1, not 0"),
    (["bench", "--picotron", "nowhere"],
     "error: --picotron nowhere: no picotron/data_parallel/data_parallel.py there"),
    (["tp-bench", "--world-sizes", "3"],
     "error: argument --world-sizes: the benchmark's 8 attention heads do not split over 3")])
def test_a_benchmark_flag_that_cannot_run_is_one_line_before_any_rank(command, message):
    result = run([sys.executable, "-m", "minddp", *command])
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert lines[0].startswith(message) and lines[1].startswith("---> HINT: "), result.stderr


def _mesh_bench(rank, world_size):
    import torch
    from minddp.bench.mesh import measure
    return {(text, impl): measure(text, impl, 8, torch.device("cpu"))
            for text in ("dp=2,tp=2", "pp=2,dp=2", "dp_replicate=2,dp_shard=2")
            for impl in ("manual", "stock")}


share_spawn(_mesh_bench, [4])


def test_mesh_bench_holds_the_formula_and_sends_what_the_composition_says():
    """minddp mesh-bench's measure() on 2-D meshes of 4 ranks, minddp's and stock's."""
    from minddp.bench.mesh import SIZES
    activation = 8 * SIZES["tokens"] * SIZES["d"] * 4 / 2**20  # one dp rank's batch, MB
    for rank, result in enumerate(shared_results(_mesh_bench, 4)):
        for (text, impl), r in result.items():
            case = f"rank {rank}, {text}, {impl}"
            assert r["held"][:3] == pytest.approx(r["formula"], rel=1e-12), case
            assert r["held"][:3] == result[text, "stock"]["held"][:3], case  # as stock's
            assert r["held"][3] > 0, case
        tp = result["dp=2,tp=2", "manual"]["sent"]
        # TP: per block 2 all_reduces forward (attn.o, mlp.down) and 4 backward (q, k, v,
        # mlp.up bring input gradients to sum), each of one batch's activations
        assert tp["tp"] == pytest.approx(SIZES["blocks"] * 6 * activation, rel=1e-12), rank
        # fully_shard over dp: minddp passes its collectives what stock's passes
        for text in ("dp=2,tp=2", "pp=2,dp=2"):
            assert result[text, "manual"]["sent"]["dp"] == result[text, "stock"]["sent"]["dp"]
        # HSDP: all_gathers and reduce_scatters within dp_shard, all_reduces down dp_replicate
        hsdp = {impl: result["dp_replicate=2,dp_shard=2", impl]["sent"] for impl in ("manual",
                                                                                  "stock")}
        assert hsdp["manual"] == hsdp["stock"] and set(hsdp["stock"]) == {"dp_replicate",
                                                                          "dp_shard"}, hsdp
        pp_stock = result["pp=2,dp=2", "stock"]["sent"]["pp"]
        pp_mine = result["pp=2,dp=2", "manual"]["sent"]["pp"]
        # 2 stages: the first sends each microbatch's activations on, the last their gradients
        # back: one batch's activations each way; minddp's first stage (ranks 0 and 1 of
        # pp=2,dp=2) sends one header more, the first activation's shape (pp/stage.py)
        assert pp_stock == pytest.approx(activation, rel=1e-12), rank
        header = (MAX_DIMS + 1) * 8 / 2**20
        assert pp_mine == pytest.approx(activation + header * (rank < 2), rel=1e-12), rank


def test_mesh_picture_draws_the_measured_bytes(tmp_path):
    from minddp.tools.pictures import draw_held_and_activations
    result = shared_results(_mesh_bench, 4)[0]
    rows = [{"ranks": 4, "way": f"{text} {impl}", "params": r["held"][0], "grads": r["held"][1],
             "optimizer": r["held"][2], "activations": r["held"][3]}
            for (text, impl), r in result.items()]
    drawn = draw_held_and_activations(rows, tmp_path / "mesh.png", "test", "title", "caption")
    for row in rows:
        bar = drawn[(4, row["way"])]
        assert [bar[k] for k in ("params", "grads", "optimizer", "gathered")] == \
               [row[k] for k in ("params", "grads", "optimizer", "activations")], row["way"]
