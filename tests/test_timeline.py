"""The overlap timeline: a Chrome trace that says what it should; the overlap figure's arithmetic.

    pytest tests/test_timeline.py
"""

import json
import re

import pytest

from helpers import cli

# 4.21M parameters (16.8 MB of float32 gradients): after the first step, 2 buckets.
TOTAL_BYTES = 4 * (4 * (1024 * 1024 + 1024) + 1024 * 10 + 10)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline") / "t.json"
    result = cli("timeline", "--size", "4M", "--world-size", "2",
                 "--steps", "3", "--out", str(out), "--png", str(out.with_suffix(".png")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "outlived" not in result.stdout  # recording holds no wrapper, so no group, alive
    traces = {kind: json.load(open(str(out).replace(".json", f"-{kind}.json")))["traceEvents"]
              for kind in ("naive", "bucketed", "stock")}
    return result.stdout, traces, out.with_suffix(".png")


def test_trace_has_both_ranks_and_both_tracks(traced):
    for kind, events in traced[1].items():
        names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M"}
        assert names == {(0, "rank 0"), (1, "rank 1"), (0, "compute"), (0, "communication"),
                         (1, "compute"), (1, "communication")}, kind


@pytest.mark.parametrize("kind", ["bucketed", "stock"])
def test_one_all_reduce_per_bucket_per_step_with_its_bytes(traced, kind):
    events = [e for e in traced[1][kind] if e["ph"] != "M"]
    for rank in (0, 1):
        for step in range(3):
            comm = [e for e in events if e["pid"] == rank and e["tid"] == 1 and e["args"]["step"] == step]
            assert sorted(e["name"] for e in comm) == (["bucket 0"] if step == 0 else ["bucket 0", "bucket 1"])
            assert sum(e["args"]["bytes"] for e in comm) == TOTAL_BYTES  # every gradient, once
            mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == step]
            start = min(e["ts"] for e in mine if e["name"] == "backward starts")
            end = max(e["ts"] + e["dur"] for e in mine if e["name"] == "optimizer step")
            # Launched inside the step (stamped by this rank's main thread, in a hook). Its
            # end is not asserted: a completion is stamped by a Python callback in the
            # backend's thread, which waits for the GIL while the main thread runs on (in one
            # run of the whole suite one ended over 5 ms past the step): a time, not the code's.
            assert all(start <= e["ts"] <= end and e["dur"] >= 0 for e in comm)


def test_naive_blocks_on_every_all_reduce_and_buckets_leave_during_backward(traced):
    # What is deterministic, not how much overlap a busy machine happens to give.
    events = {kind: [e for e in evs if e["ph"] != "M"] for kind, evs in traced[1].items()}
    for rank in (0, 1):
        naive = [e for e in events["naive"] if e["pid"] == rank and e["args"]["step"] == 2]
        comm = [e for e in naive if e["tid"] == 1]
        blocked = [e for e in naive if e["name"] == "blocked: all_reduce"]
        assert len(comm) == 10 and len(blocked) == 10  # one per parameter, each blocking
        assert [(e["ts"], e["dur"]) for e in comm] == [(e["ts"], e["dur"]) for e in blocked]
        bucketed = [e for e in events["bucketed"] if e["pid"] == rank and e["args"]["step"] == 2]
        first = min(e["ts"] for e in bucketed if e["name"] == "bucket 0")
        last_grad = max(e["ts"] for e in bucketed if e["name"].startswith("grad "))
        assert first < last_grad  # bucket 0 leaves while backward is still computing
        assert any(e["name"] == "blocked: wait for buckets" for e in bucketed)
    # The overlap figure is printed for each, a measurement: no threshold is asserted.
    for kind in ("naive", "bucketed", "stock"):
        assert re.search(rf"^{kind}: communication overlapped with backward: \d+%, \d+%",
                         traced[0], re.M), traced[0]
    # The text picture draws naive's blocked spans in each rank's compute row (the legend's
    # "B blocked" line does not count: only what is between the row's bars).
    naive_text = traced[0].split("\nnaive:")[1].split("\nbucketed:")[0]
    rows = re.findall(r"^rank (\d) compute \|(.*)\|$", naive_text, re.M)
    assert [r for r, _ in rows] == ["0", "1"] and all("B" in bar for _, bar in rows), naive_text


def test_overlap_arithmetic_on_a_synthetic_trace():
    from minddp.tools.overlap import COMM, COMPUTE, overlap

    def ev(track, name, ts, dur=0.0, **args):
        return {"step": 0, "track": track, "name": name, "ts": ts, "dur": dur, "args": args}
    # Backward computes from 0 to 100; communication 50-150 and 160-200 (140 in all); of the
    # 50 us inside the backward window, 20 are blocked: (50 - 20) / 140 overlapped.
    events = [ev(COMPUTE, "backward starts", 0), ev(COMPUTE, "grad a", 100),
              ev(COMM, "bucket 0", 50, 100), ev(COMM, "bucket 1", 160, 40),
              ev(COMPUTE, "blocked: all_reduce", 60, 20, blocked=True)]
    assert overlap(events, 0) == (50 - 20) / 140
    assert overlap([e for e in events if e["track"] != COMM], 0) is None  # nothing sent


def test_missing_out_directory_is_refused_before_training(tmp_path):
    result = cli("timeline", "--out", str(tmp_path / "no" / "t.json"))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: --out {tmp_path / 'no' / 't.json'}: its directory")
    assert len(result.stderr.splitlines()) == 2


def test_world_size_one_works_and_says_so(tmp_path):
    result = cli("timeline", "--size", "0.3M", "--world-size", "1",
                 "--ddp", "bucketed", "--out", str(tmp_path / "one.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "world size 1: nothing to communicate" in result.stdout
    assert "communication overlapped with backward: n/a" in result.stdout
    assert json.load(open(tmp_path / "one.json"))["traceEvents"]


def test_the_picture_draws_the_recorded_events(traced):
    import matplotlib.image
    from minddp.tools.pictures import draw_timeline
    from minddp.tools.timeline import read_chrome_trace
    stdout, traces, png = traced
    assert f"picture: {png}" in stdout
    assert matplotlib.image.imread(png).shape == (760, 1000, 4)  # 3 panels of 2 ranks, 100 dpi
    # Draw the recorded traces again, here, and read the bars back from the figure: each
    # all-reduce and each span is where the trace puts it (ms from the step's first event).
    kinds = ["naive", "bucketed", "stock"]
    panels = [(kind, read_chrome_trace(str(png).replace(".png", f"-{kind}.json")), 2)
              for kind in kinds]
    drawn = draw_timeline(panels, png.with_name("again.png"), "test")
    for i, (kind, everyone, step) in enumerate(panels):
        t0 = min(e["ts"] for events in everyone for e in events if e["step"] == step)
        for rank, events in enumerate(everyone):
            mine = [e for e in events if e["step"] == step]
            comm = sorted((e["name"], round((e["ts"] - t0) / 1e3, 6), round(e["dur"] / 1e3, 6))
                          for e in mine if e["track"] == "communication" and e["dur"] > 0)
            bars = sorted((label, round(x, 6), round(w, 6)) for p, r, track, label, x, w in drawn
                          if (p, r, track) == (i, rank, "communication"))
            assert bars == comm and len(comm) >= 2, (kind, rank)
            grads = [e["ts"] for e in mine if e["name"].startswith("grad ")]
            backward = [(round(x, 6), round(w, 6)) for p, r, track, label, x, w in drawn
                        if (p, r, label) == (i, rank, "backward")]
            start = min(e["ts"] for e in mine if e["name"] == "backward starts")
            assert backward == [(round((start - t0) / 1e3, 6), round((max(grads) - start) / 1e3, 6))]


def test_a_recorded_trace_is_drawn_without_running(traced, tmp_path):
    _, _, png = traced
    trace = str(png).replace(".png", "-bucketed.json")
    result = cli("timeline", "--trace", trace,
                 "--png", str(tmp_path / "b.png"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"picture: {tmp_path / 'b.png'}" in result.stdout and "step 2" in result.stdout
    assert "rank 1 comm" in result.stdout  # the text timeline of the same step
    from minddp import UsageError
    from minddp.tools.timeline import read_chrome_trace
    with pytest.raises(UsageError, match="cannot read .* as a minddp trace"):
        read_chrome_trace(png)  # a PNG is not a trace
