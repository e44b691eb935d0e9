"""Virtual pipeline stages (minddp/pp/interleaved.py) against torch.distributed.pipelining.

    pytest tests/test_pp_interleaved.py

Every rank's list of actions, for many (ranks, stages per rank, microbatches), equal to
stock's `get_schedule_ops` (None slots included), in-process. Then one spawn per world
size (2 ranks with 4 stages, 4 ranks with 8) trains the same layers with stock's schedule
and minddp's, 3 AdamW steps: per rank and step the losses, every gradient of every local
stage and every updated weight `torch.equal` to stock's and to one process accumulating the
microbatches in the schedule's order; and the actions each rank ran, recorded from stock's
stages while they ran, equal to minddp's, action for action.
"""

import contextlib
import copy
import importlib.util
import io
import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import pipelining as stock_pp
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from helpers import (REPO, differences_from_stock, run, share_spawn, shared_results,
                     usage_errors)
from minddp import pp
from minddp.pp import interleaved as pp_interleaved, v_shaped as pp_v, zero_bubble as pp_zero_bubble

WIDTH, BATCH, LOCAL = 16, 16, 2  # LOCAL: stages per rank

def _zero_bubble(ranks, local, n):
    lists = [pp_interleaved.interleaved_1f1b(r, ranks, local, n, zero_bubble=True)
             for r in range(ranks)]
    return pp_zero_bubble.add_bubbles(lists, ranks * local)


# name: (every rank's list for (ranks, stages per rank, n), minddp's schedule, placement)
SCHEDULES = {
    "Interleaved1F1B": (lambda p, v, n: [pp_interleaved.interleaved_1f1b(r, p, v, n)
                                         for r in range(p)],
                        pp_interleaved.ScheduleInterleaved1F1B, pp_interleaved.loop_placement),
    "LoopedBFS": (lambda p, v, n: [pp_interleaved.looped_bfs(r, p, v, n) for r in range(p)],
                  pp_interleaved.ScheduleLoopedBFS, pp_interleaved.loop_placement),
    "InterleavedZeroBubble": (_zero_bubble, pp_zero_bubble.ScheduleInterleavedZeroBubble,
                              pp_interleaved.loop_placement),
    "ZBVZeroBubble": (lambda p, v, n: [pp_v.zbv(r, p, n) for r in range(p)],
                      pp_v.ScheduleZBVZeroBubble, pp_v.v_placement),
    "DualPipeV": (lambda p, v, n: [pp_v.dualpipev(r, p, n) for r in range(p)],
                  pp_v.ScheduleDualPipeV, pp_v.v_placement),
}


def _flat(actions):
    """Stock's list as strings, an overlapped pair (DualPipeV's OVERLAP_F_B) as its two."""
    out = []
    for a in actions:
        out += [str(s) for s in a.sub_actions] if a is not None and a.sub_actions else \
            [None if a is None else str(a)]
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_ranks_actions_are_stocks(name):
    lists = SCHEDULES[name][0]
    for ranks in (2, 3, 4):
        for local in (2, 3) if "V" not in name else (2,):
            for n in (2, 3, 4, 6, 8, 12):
                if name == "DualPipeV" and n < 2 * ranks:
                    continue  # stock refuses it (as minddp: test_bad_input_is_one_line)
                stock = get_schedule_ops(name, ranks, n, num_stages_per_rank=local)
                ours = lists(ranks, local, n)
                for rank in range(ranks):
                    assert ours[rank] == _flat(stock[rank]), (ranks, local, n, rank)


def model():  # 16 layers: 8 Linear, each followed by Tanh; 8 stages of one Linear each at most
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _recorded(stages, log):
    """Stock's stages, noting each action they run as "sFi", "sBi", "sIi" or "sWi"."""
    for stage in stages:
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight = stage.backward_weight_one_chunk

        def forward_one_chunk(i, *args, _s=stage.stage_index, _f=forward, **kwargs):
            log.append(f"{_s}F{i}")
            return _f(i, *args, **kwargs)

        def backward_one_chunk(i, *args, _s=stage.stage_index, _b=backward, **kwargs):
            log.append(f"{_s}{'B' if kwargs.get('full_backward', True) else 'I'}{i}")
            return _b(i, *args, **kwargs)

        def backward_weight_one_chunk(i, *args, _s=stage.stage_index, _w=weight, **kwargs):
            log.append(f"{_s}W{i}")
            return _w(i, *args, **kwargs)
        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk


def _case(rank, world_size, name, n, steps=3):
    """Per step: what differs between stock, minddp and one process; and the actions run."""
    num_stages = LOCAL * world_size
    local = [s for s in range(num_stages) if SCHEDULES[name][2](s, world_size) == rank]
    whole = model()
    layers = {who: [copy.deepcopy(pp.stage_layers(whole, s, num_stages)) for s in local]
              for who in ("stock", "minddp")}
    stock_stages = [stock_pp.PipelineStage(m, s, num_stages, torch.device("cpu"))
                    for m, s in zip(layers["stock"], local)]
    stock_log = []
    _recorded(stock_stages, stock_log)
    ours_stages = [pp.PipelineStage(m, s, num_stages) for m, s in zip(layers["minddp"], local)]
    runners = {"stock": getattr(stock_pp, f"Schedule{name}")(stock_stages, n, loss_fn=F.mse_loss),
               "minddp": SCHEDULES[name][1](ours_stages, n, loss_fn=F.mse_loss)}
    params = {who: [p for m in ms for p in m.parameters()] for who, ms in layers.items()}
    mine = [p for s in local for p in pp.stage_layers(whole, s, num_stages).parameters()]
    params["one process"] = mine
    optimizers = {"stock": torch.optim.AdamW(params["stock"], lr=1e-2, foreach=False),
                  "minddp": torch.optim.AdamW(params["minddp"], lr=1e-2, foreach=False),
                  "one process": torch.optim.AdamW(whole.parameters(), lr=1e-2, foreach=False)}
    first, last = 0 in local, num_stages - 1 in local
    verdicts = []
    for step in range(steps):
        x, y = batch(step)
        seen = {}
        for who, runner in runners.items():
            optimizers[who].zero_grad()
            losses = []
            runner.step(*([x] if first else []), target=y if last else None,
                        losses=losses if last else None)
            seen[who] = ([loss.item() for loss in losses], [p.grad.clone() for p in params[who]])
        optimizers["one process"].zero_grad()  # gradient accumulation, divided once (as stock)
        order = range(n) if name != "LoopedBFS" else reversed(range(n))  # its backwards: last first
        pieces = list(zip(x.chunk(n), y.chunk(n)))
        outs = [F.mse_loss(whole(xi), yi) for xi, yi in pieces]
        for i in order:
            outs[i].backward()
        for p in whole.parameters():
            p.grad.div_(n)
        seen["one process"] = ([o.item() for o in outs] if last else [],
                               [p.grad.clone() for p in mine])
        for optimizer in optimizers.values():
            optimizer.step()
        verdicts.append(differences_from_stock(seen, params) or "equal")
    return verdicts, stock_log, runners["minddp"].log * steps


CASES = {2: [(name, n) for name in SCHEDULES for n in (4, 8)],
         4: [(name, n) for name in SCHEDULES for n in (4, 8) if (name, n) != ("DualPipeV", 4)]
         + [("DualPipeV", 16)]}


def _mistakes(rank, world_size):
    """What each schedule refuses, on 2 ranks (each rank its own stages of 4)."""
    def stages(indices):
        return [pp.PipelineStage(pp.stage_layers(model(), s, 4), s, 4) for s in indices]
    loop, v = [rank, rank + 2], [rank, 3 - rank]
    return usage_errors([
        ("a V schedule on a loop's stages", lambda: pp_v.ScheduleZBVZeroBubble(
            stages(loop), 4, F.mse_loss)),
        ("a loop schedule on a V's stages", lambda: pp_interleaved.ScheduleInterleaved1F1B(
            stages(v), 4, F.mse_loss)),
        ("DualPipeV, fewer microbatches than stages", lambda: pp_v.ScheduleDualPipeV(
            stages(v), 2, F.mse_loss)),
        ("interleaved, microbatches not a multiple of the rounds", lambda:
            pp_interleaved.ScheduleInterleaved1F1B(stages(loop), 5, F.mse_loss).order()),
        ("ZBV, three stages per rank", lambda: pp_v.ScheduleZBVZeroBubble(
            [pp.PipelineStage(pp.stage_layers(model(), s, 6), s, 6)
             for s in (rank, 3 - rank, 4 + rank)], 4, F.mse_loss)),
        ("one-stage schedule, two stages", lambda: pp.ScheduleGPipe(stages(loop)[0], 4,
                                                                    F.mse_loss)),
        ("a W before its I", lambda: _w_first(stages(loop))),
    ])


def _w_first(stages):
    """A zero-bubble schedule whose list starts with a W (before any forward: no rank waits)."""
    schedule = pp_zero_bubble.ScheduleInterleavedZeroBubble(stages, 4, F.mse_loss)
    schedule.order = lambda: schedule.parsed([f"{stages[0].index}W0"])
    x, y = batch(0)
    schedule.step(*([x] if stages[0].is_first else []), target=y if stages[-1].is_last else None)


def _batch_refused(rank, world_size):
    """Every schedule given a batch its microbatches do not divide: what each rank says.
    Only the first stage sees the batch; a rank of middle stages learns it from the refusal
    that travels in the first activation's place (pp/stage.py, PipelineStage.refuse)."""
    said = {}
    for name in ["ScheduleGPipe", "Schedule1F1B"] + [f"Schedule{n}" for n in SCHEDULES]:
        local = 1 if name in ("ScheduleGPipe", "Schedule1F1B") else LOCAL
        num_stages = local * world_size
        place = pp_v.v_placement if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") \
            else pp_interleaved.loop_placement
        mine = [s for s in range(num_stages) if place(s, world_size) == rank]
        stages = [pp.PipelineStage(pp.stage_layers(model(), s, num_stages), s, num_stages)
                  for s in mine]
        schedule = getattr(pp, name)(stages if local > 1 else stages[0], 2 * num_stages,
                                     F.mse_loss)
        x = torch.randn(2 * num_stages + 1, WIDTH)
        said.update(usage_errors([(name, lambda: schedule.step(
            *([x] if 0 in mine else []), target=x if num_stages - 1 in mine else None))]))
    return said


VIRTUAL = ["interleaved-1f1b", "looped-bfs", "zb1p", "zbv", "dualpipev"]
TABLES = os.path.join(tempfile.gettempdir(), f"minddp-pp-virtual-{os.getpid()}")


def _example_tables(rank, world_size, tables):
    """examples/pipeline.py's main() for each virtual schedule, --pp manual and stock."""
    from minddp.launch.start import DDPEnv
    from minddp.run.cli import lesson_parser
    spec = importlib.util.spec_from_file_location("pipeline", REPO / "examples" / "pipeline.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    env = DDPEnv(rank, rank, world_size, "gloo", torch.device("cpu"), 120)
    os.makedirs(tables, exist_ok=True)
    printed = {}
    for schedule in VIRTUAL:
        for impl in ("manual", "stock"):
            args = lesson_parser(example.__doc__, pp=True).parse_args(
                ["--schedule", schedule, "--microbatches", "4", "--pp", impl, "--grad-table",
                 os.path.join(tables, f"{schedule}-{impl}.txt")])
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                example.main(env, args)
            printed[schedule, impl] = out.getvalue()
    return printed


def _everything(rank, world_size, tables):
    out = {case: _case(rank, world_size, *case) for case in CASES[world_size]}
    if world_size == 2:
        out["mistakes"] = _mistakes(rank, world_size)
        out["example"] = _example_tables(rank, world_size, tables)
    else:
        out["batch refused"] = _batch_refused(rank, world_size)
    return out


@pytest.mark.parametrize("mistake, message", [
    ("a V schedule on a loop's stages", "ScheduleZBVZeroBubble places stages [0, 3] on rank 0,"
                                        " which was given stages [0, 2]"),
    ("a loop schedule on a V's stages", "ScheduleInterleaved1F1B places stages [0, 2] on"
                                        " rank 0, which was given stages [0, 3]"),
    ("DualPipeV, fewer microbatches than stages", "DualPipeV with 2 microbatches on 4 stages:"
                                                  " it needs at least one per stage"),
    ("interleaved, microbatches not a multiple of the rounds", "Interleaved 1F1B with 5"
     " microbatches on 2 ranks: 5 is not a multiple of the 2 rounds"),
    ("ZBV, three stages per rank", "ScheduleZBVZeroBubble runs 2 stages per rank, not 3"),
    ("one-stage schedule, two stages", "4 stages on 2 ranks: ScheduleGPipe runs one stage per"
                                       " rank"),
    ("a W before its I", "stage 0: W0 before I0: the weights' gradients start from what I"
                         " kept"),
])
def test_bad_input_is_one_line(mistake, message):
    said = shared_results(_everything, 2)[0]["mistakes"][mistake]
    assert said is not None and said.startswith(message), said


share_spawn(_everything, [2, 4], TABLES)


def test_a_batch_the_microbatches_do_not_divide_is_refused_on_every_rank():
    # 4 ranks: ranks 1 and 2 hold no first or last stage (in a loop; in a V, ranks 1-3), so
    # they never see the batch, and say so all the same, instead of waiting in recv
    for rank, out in enumerate(shared_results(_everything, 4)):
        said = out["batch refused"]
        assert len(said) == 7, said
        for name, message in said.items():
            assert message is not None and message.startswith(
                "a batch of 17 cannot be cut into 16 equal microbatches"
                if name not in ("ScheduleGPipe", "Schedule1F1B") else
                "a batch of 9 cannot be cut into 8 equal microbatches"), (rank, name, message)


# to the session's end: this module's tests that read a shared spawn run last (conftest)
@pytest.fixture(scope="session", autouse=True)
def _clean_tables():
    yield
    shutil.rmtree(TABLES, ignore_errors=True)


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_the_pipeline_example_with_virtual_stages_is_identical_to_stocks(schedule):
    printed = shared_results(_everything, 2)
    verdict = run([sys.executable, "-m", "minddp", "diff",
                   os.path.join(TABLES, f"{schedule}-manual.txt"),
                   os.path.join(TABLES, f"{schedule}-stock.txt")])
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout
    # 20 examples, batches of 4, 3 epochs; 4 Linear layers (one added), each with a bias
    assert "world size 2, 15 steps, 8 parameters" in verdict.stdout, verdict.stdout
    rank0 = printed[0]["example"][schedule, "manual"]
    held = "0, 3" if schedule in ("zbv", "dualpipev") else "0, 2"  # a V or a loop
    assert f"[rank0] stage {held}, {schedule}: 0F0 " in rank0, rank0


@pytest.mark.parametrize("world_size,case", [(w, c) for w, cs in CASES.items() for c in cs],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else
                         f"{v}_ranks")
def test_virtual_stages_are_bitwise_stocks_action_for_action(world_size, case):
    name, n = case
    expected = get_schedule_ops(name, world_size, n, num_stages_per_rank=LOCAL)
    for rank, out in enumerate(shared_results(_everything, world_size)):
        verdicts, stock_log, ours_log = out[case]
        assert verdicts == ["equal"] * 3, f"rank {rank}: {verdicts}"
        assert ours_log == stock_log, f"rank {rank}: the actions differ from what stock ran"
        assert ours_log[:len(ours_log) // 3] == [a for a in _flat(expected[rank]) if a], rank


def test_every_schedules_timeline_has_the_formulas_bubble():
    """minddp pp-schedules: each schedule's actions laid out in time (tools/pipeline_slots.py)."""
    from minddp.tools.pipeline_slots import figures, schedules
    for p in (2, 3, 4):
        for m in (4, 8, 12):
            for name, (v, lists) in schedules(p, m).items():
                if lists is None:
                    continue  # DualPipeV below 2p microbatches: refused
                row = figures(name, v, lists, p, m)
                for rank in row["spans"]:  # every action ran: m forwards and backwards per rank
                    assert sum(end - start for _, start, end in rank) == 3 * m, name
                if row["formula"] is not None:
                    assert row["bubble"] == pytest.approx(row["formula"]), (name, p, m)
                else:  # zero bubble: below interleaved 1F1B's, whose stages per rank it shares
                    assert row["bubble"] < (p - 1) / (v * m + p - 1), (name, p, m)
                if name == "1F1B":
                    assert row["alive"] == [min(m, p - r) for r in range(p)]
                if name == "GPipe":
                    assert row["alive"] == [m] * p


def test_pp_schedules_draws_every_schedule(tmp_path):
    import matplotlib.image
    from minddp.tools.pipeline_slots import main
    rows = main(["--ranks", "2", "--microbatches", "4", "--png", str(tmp_path / "s.png")])
    assert [r["schedule"] for r in rows] == ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                                             "InterleavedZeroBubble", "ZBVZeroBubble",
                                             "DualPipeV"]
    assert matplotlib.image.imread(tmp_path / "s.png").shape[1] == 1300
