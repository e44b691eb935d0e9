"""minddp.pp (pipeline parallelism by hand) against torch.distributed.pipelining, bit for bit.

    pytest tests/test_pp.py

One spawn per world size (2 and 4 stages) runs every case: the same layers, the same batches,
3 AdamW steps through stock's PipelineStage and Schedule{GPipe,1F1B}, through minddp's, and
through one process accumulating the microbatches' gradients over the whole model. Per rank
and step: the last stage's losses, every gradient of the stage and every updated weight
`torch.equal` across the three; the order of the stage's forwards and backwards, recorded
from stock's stage while it ran, equal to minddp's; and minddp's messages, one per tensor.
Each case is a test of its own.
"""

import contextlib
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage as StockStage
from torch.distributed.pipelining import Schedule1F1B as StockOneFOneB
from torch.distributed.pipelining import ScheduleGPipe as StockGPipe

from helpers import differences_from_stock, share_spawn, shared_results, usage_errors
from minddp import pp
from minddp.pp.stage import MAX_DIMS

WIDTH, BATCH = 16, 16
SCHEDULES = {"gpipe": (pp.ScheduleGPipe, StockGPipe), "1f1b": (pp.Schedule1F1B, StockOneFOneB)}


def model():  # 8 layers: 4 Linear, each followed by Tanh; rows and columns of one width
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _recorded(stage):
    """Stock's stage, its forward_one_chunk and backward_one_chunk noting F<i> and B<i>."""
    log = []
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(i, *args, **kwargs):
        log.append(f"F{i}")
        return forward(i, *args, **kwargs)

    def backward_one_chunk(i, *args, **kwargs):
        log.append(f"B{i}")
        return backward(i, *args, **kwargs)
    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    return log


def _case(rank, world_size, schedule, n, steps=3):
    """Per step: the first things that differ between stock, minddp and one process."""
    ours_cls, stock_cls = SCHEDULES[schedule]
    whole = model()
    layers = {who: copy.deepcopy(pp.stage_layers(whole, rank, world_size))
              for who in ("stock", "minddp")}
    stock_stage = StockStage(layers["stock"], rank, world_size, torch.device("cpu"))
    stock_log = _recorded(stock_stage)
    ours_stage = pp.PipelineStage(layers["minddp"], rank, world_size)
    runners = {"stock": stock_cls(stock_stage, n, loss_fn=F.mse_loss),
               "minddp": ours_cls(ours_stage, n, loss_fn=F.mse_loss)}
    optimizers = {who: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
                  for who, m in list(layers.items()) + [("one process", whole)]}
    mine = pp.stage_layers(whole, rank, world_size)  # this stage's layers in the whole model
    verdicts, sent = [], []  # sent: per step, the numel of each message minddp's rank sent
    for step in range(steps):
        x, y = batch(step)
        seen = {}
        for who, runner in runners.items():
            optimizers[who].zero_grad()
            losses = []
            with _counting_isend(sent if who == "minddp" else None):
                if rank == 0:
                    runner.step(x)
                elif rank == world_size - 1:
                    runner.step(target=y, losses=losses)
                else:
                    runner.step()
            seen[who] = ([loss.item() for loss in losses],
                         [p.grad.clone() for p in layers[who].parameters()])
        optimizers["one process"].zero_grad()  # gradient accumulation, divided once (as stock)
        reference_losses = []
        for xi, yi in zip(x.chunk(n), y.chunk(n)):
            loss = F.mse_loss(whole(xi), yi)
            loss.backward()
            reference_losses.append(loss.item())
        for p in whole.parameters():
            p.grad.div_(n)
        seen["one process"] = (reference_losses if rank == world_size - 1 else [],
                               [p.grad.clone() for p in mine.parameters()])
        for optimizer in optimizers.values():
            optimizer.step()
        weights = {who: [p.detach() for p in m.parameters()]
                   for who, m in (("stock", layers["stock"]), ("minddp", layers["minddp"]),
                                  ("one process", mine))}
        verdicts.append(differences_from_stock(seen, weights) or "equal")
    return verdicts, stock_log, ours_stage.log, sent


@contextlib.contextmanager
def _counting_isend(sent):
    """Records the size of each isend made inside (the stage calls dist.isend)."""
    real = dist.isend
    if sent is not None:
        sent.append([])
        dist.isend = lambda tensor, *args, **kwargs: (sent[-1].append(tensor.numel()),
                                                      real(tensor, *args, **kwargs))[1]
    try:
        yield
    finally:
        dist.isend = real


CASES = {2: [("gpipe", 4), ("1f1b", 4), ("gpipe", 8), ("1f1b", 8)],
         4: [("gpipe", 4), ("1f1b", 4)]}


def _mistakes(rank, world_size):
    layers = pp.stage_layers(model(), rank, world_size)
    stage = pp.PipelineStage(layers, rank, world_size)
    x, y = batch(0)
    return usage_errors([
        ("more stages than layers", lambda: pp.stage_layers(nn.Sequential(nn.Linear(2, 2)),
                                                            0, world_size)),
        ("batch not divisible", lambda: pp.ScheduleGPipe(stage, 3, F.mse_loss).step(
            x, target=y)),
        ("stage without weights", lambda: pp.PipelineStage(nn.Tanh(), rank, world_size)),
        ("a stage of the cut without weights", lambda: pp.stage_layers(
            nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Tanh(), nn.Linear(4, 4)), rank, 3)),
        ("stages not ranks", lambda: pp.PipelineStage(layers, rank, world_size + 1))])


def _bench(rank, world_size):
    """pp-bench's measurement (bench/pp.py), one small round of every schedule: its rows,
    and its picture."""
    from argparse import Namespace
    from minddp.bench.pp import SCHEDULES, pp_size
    args = Namespace(batch=16, microbatches=[4], warmup=0, rounds=1, schedules=SCHEDULES)
    rows = pp_size("0.3M", args, rank, world_size, torch.device("cpu"))
    if rank != 0:
        return rows, None
    from minddp.tools.bubble import draw_pipeline
    import matplotlib.image
    png = os.path.join(tempfile.mkdtemp(), "bubble.png")
    drawn = draw_pipeline([r for r in rows if r["events"]], png, "test")
    return rows, (matplotlib.image.imread(png).shape, drawn)


def _everything(rank, world_size):
    out = {"cases": {case: _case(rank, world_size, *case) for case in CASES[world_size]}}
    if world_size == 2:
        dist.barrier()
        out["mistakes"] = _mistakes(rank, world_size)
        out["bench"] = _bench(rank, world_size)
    return out


share_spawn(_everything, [2, 4])


def _results(world_size):
    return shared_results(_everything, world_size)


@pytest.mark.parametrize("world_size,case", [(w, c) for w, cs in CASES.items() for c in cs],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else
                         f"{v}_stages")
def test_pipeline_bitwise_equal_to_stock_and_to_one_process(world_size, case):
    for rank, out in enumerate(_results(world_size)):
        verdicts, stock_log, ours_log, sent = out["cases"][case]
        assert verdicts == ["equal"] * 3, f"rank {rank}: {verdicts}"
        assert ours_log == stock_log, f"rank {rank}: the order of F and B differs from stock's"
        # One message per tensor, and per step one header ahead of the first activation:
        # n + 1 activations' messages to the next stage, n gradients to the one before.
        n = case[1]
        expected = ([MAX_DIMS + 1] if rank < world_size - 1 else []) + \
            [BATCH // n * WIDTH] * (n * (rank < world_size - 1) + n * (rank > 0))
        assert [sorted(step) for step in sent] == [sorted(expected)] * 3, (rank, sent)


def test_gpipe_and_1f1b_differ_only_in_order():
    # The numbers cannot tell the schedules apart; the recorded order does.
    # At 4 stages and 4 microbatches 1F1B's first stage warms up with all 4 forwards: the
    # same order as GPipe there; every other stage starts a backward before its last forward.
    for rank, out in enumerate(_results(4)):
        gpipe, one_f_one_b = out["cases"][("gpipe", 4)][2], out["cases"][("1f1b", 4)][2]
        assert sorted(gpipe) == sorted(one_f_one_b), rank
        assert (gpipe == one_f_one_b) == (rank == 0), (rank, gpipe, one_f_one_b)


@pytest.mark.parametrize("mistake,message", [
    ("more stages than layers", "2 stages of a model of 1 layers: stage 1 would hold no weights"),
    ("batch not divisible", "a batch of 16 cannot be cut into 3 equal microbatches"),
    ("stage without weights", "has no parameters"),
    ("a stage of the cut without weights", "3 stages of a model of 4 layers: stage 1 would hold"),
    ("stages not ranks", "3 stages on 2 ranks: the stages must share the ranks evenly")])
def test_bad_input_is_one_line(mistake, message):
    for out in _results(2):
        said = out["mistakes"][mistake]
        assert said is not None and message in said, said


def test_pp_bench_counts_the_activations_each_schedule_keeps_alive():
    # From the order each rank ran (recorded, minddp's and stock's): as many activations alive
    # at most as the schedule's lists keep (tools/pipeline_slots.py); GPipe all m, 1F1B p - s.
    from minddp.tools.pipeline_slots import figures, schedules
    rows, (shape, drawn) = _results(2)[0]["bench"]
    lists = schedules(2, 4)
    alive = {r["way"]: r["alive"] for r in rows}
    assert len(alive) == 14, sorted(alive)
    for name, (v, actions) in lists.items():
        expected = figures(name, v, actions, 2, 4)["alive"]
        assert alive[f"minddp {name}"] == alive[f"stock {name}"] == expected, name
    assert alive["minddp GPipe"] == [4, 4] and alive["minddp 1F1B"] == [2, 1]
    assert all(0 <= idle < 1 for r in rows for idle in r["idle"])
    assert all(r["laid out"] == pytest.approx(r["formula"]) for r in rows if r["formula"])
    assert shape == (1660, 1200, 4)  # seven panels (minddp's schedules) of two ranks
    # The picture's bars are the recorded events: each rank's actions, those of its list.
    for name, (v, actions) in lists.items():
        for rank in (0, 1):
            bars = sorted(a for a, *_ in drawn[(name, rank)] if not a.startswith("-1"))
            assert bars == sorted(filter(None, actions[rank])), (name, rank)
