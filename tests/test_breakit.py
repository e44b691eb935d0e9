"""Break it and see: each DDP ingredient left out shows its symptom, in numbers; check_replicas.

    pytest tests/test_breakit.py
"""

import re
import sys

import pytest
import torch

from ahead import ahead_run, ahead_torchrun
from helpers import REPO, cli, share_spawn, shared_results, warm_torchrun
from minddp import ReplicaError, UsageError, check_replicas

BREAK = REPO / "examples" / "break_ddp.py"
STOCK = REPO / "examples" / "stock_ddp.py"


@pytest.fixture(scope="module")
def verdicts(breaks):
    return breaks[0]


@pytest.fixture(scope="module")
def breaks(launch):
    """One run of every break at 2 processes: its verdicts and one gradient table per break."""
    result, table = launch(BREAK, 2, "--break", "all")
    verdicts = dict(re.findall(r"^verdict: (\w+): (.*)$", result.stdout, re.M))
    stem = table.with_suffix("")
    return verdicts, {broken: f"{stem}-{broken}.txt" for broken in verdicts}


def test_none_keeps_replicas_identical(verdicts):
    assert verdicts["none"] == "replicas identical after every step (3 steps)"


@pytest.mark.parametrize("broken,start", [("broadcast", "from the start"), ("average", "from step 1 on")])
def test_broadcast_and_average_make_replicas_differ(verdicts, broken, start):
    found = re.fullmatch(rf"replicas differ {start}: '(\S+)' on rank 1 differs from rank 0's"
                         r" \(largest absolute difference ([0-9.e+-]+)\)", verdicts[broken])
    assert found, verdicts[broken]
    assert found.group(1) == "layers.0.weight" and float(found.group(2)) > 0


def test_divide_gives_world_size_times_the_gradient(verdicts):
    found = re.search(r"every gradient is ([0-9.]+)x stock DDP's \(min ([0-9.]+)x, max ([0-9.]+)x\)"
                      r" at world size 2", verdicts["divide"])
    assert found and verdicts["divide"].startswith("replicas identical"), verdicts["divide"]
    assert [float(f) for f in found.groups()] == [2.0, 2.0, 2.0]


def test_set_epoch_repeats_the_order(verdicts):
    assert verdicts["set_epoch"].startswith("same order every epoch on every rank (3 epochs)")
    for rank in (0, 1):
        epochs = re.search(rf"rank {rank} ((?:\[[0-9, ]+\] ?)+)", verdicts["set_epoch"]).group(1)
        orders = re.findall(r"\[[0-9, ]+\]", epochs)
        assert len(orders) == 3 and len(set(orders)) == 1


def test_shard_sees_every_example_world_size_times(verdicts):
    assert verdicts["shard"].startswith("duplicate: each of the 5 examples is seen 2 times per epoch")


@pytest.fixture(scope="module")
def tables(breaks, launch):
    return {**breaks[1], "stock": launch(STOCK, 2)[1]}


def diff(a, b):
    return cli("diff", a, b)  # in this process (test_ddp.py runs the command)


def test_diff_finds_the_missing_division_and_the_skipped_average(tables):
    assert "verdict: IDENTICAL" in diff(tables["none"], tables["stock"]).stdout  # the inline DDP
    divided = diff(tables["divide"], tables["stock"])
    assert divided.returncode == 1
    assert "2.000x: at step 0 A's gradients are 2.000 times B's, element by element: a sum not" \
           " divided by world size?" in divided.stdout
    skipped = diff(tables["average"], tables["stock"])
    assert skipped.returncode == 1
    assert "table A: at step 0 rank 1's 'layers.0.weight' differs from rank 0's" in skipped.stdout
    assert "the averaging was skipped" in skipped.stdout and "table B:" not in skipped.stdout


MISTAKES = {name: ahead_run([sys.executable, str(BREAK), "--break", name])
            for name in ("nothing", "divide")}


@pytest.mark.parametrize("name,message", [
    ("nothing", "error: unknown --break 'nothing': choose one of all, none, broadcast,"
                " average, divide, set_epoch, shard"),
    ("divide", "error: the break-it demo needs 2 or more processes"),
])
def test_break_mistakes_are_one_line_and_a_hint(name, message):
    result = MISTAKES[name].result()
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith(message) and lines[1].startswith("---> HINT:") and len(lines) == 2
    if "processes" in message:
        assert "torchrun --nproc_per_node=2 examples/break_ddp.py --break divide" in lines[1]


def test_lesson_example_checks_replicas_every_step():
    result = warm_torchrun(2, REPO / "examples" / "manual_ddp.py", "--check-replicas")
    assert result.returncode == 0 and "Test accuracy 1.0" in result.stdout, result.stderr[-2000:]


class TiedWithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 4)
        self.head.weight = self.embed.weight  # tied: one tensor, listed once


def _check(rank, world_size, where):
    torch.manual_seed(0)
    model = TiedWithBuffer() if where != "shape" else torch.nn.Linear(3, 3 + rank)
    if rank == 1 and where == "weight":
        with torch.no_grad():
            model.embed.weight[2, 1] += 1e-6  # one element, one rank
    if rank == 1 and where == "buffer":
        model.norm.running_mean[0] = 0.5
    try:
        check_replicas(model)
        return "identical"
    except ReplicaError as err:
        return "ReplicaError: " + err.message
    except UsageError as err:
        return "UsageError: " + err.message


for _where in ("nowhere", "weight", "buffer", "shape"):  # in the suite's shared 2-rank spawn
    share_spawn(_check, [2], _where, key=_where)


@pytest.mark.parametrize("where,expected", [
    ("nowhere", "identical"),
    ("weight", "ReplicaError: replicas differ: 'embed.weight' on rank 1 differs from rank 0's"
               " (largest absolute difference 9.984e-07)"),  # 1e-6, as float32 rounds it there
    ("buffer", "ReplicaError: replicas differ: 'norm.running_mean' on rank 1 differs from rank 0's"
               " (largest absolute difference 5.000e-01)"),
    ("shape", "UsageError: rank 1's model differs from rank 0's at parameter #0"),
])
def test_check_replicas(where, expected):
    for message in shared_results(_check, 2, key=where):
        assert message.startswith(expected), message


FSDP_BREAKS = ahead_run([sys.executable, str(REPO / "examples" / "break_fsdp.py"), "--break",
                         "all"])


def test_fsdp_breaks_show_their_damage():
    # World size 1 shows both: the freed weights and the storage never freed.
    result = FSDP_BREAKS.result()
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    verdicts = dict(zip(lines[0::2], lines[1::2]))
    none, gather, free = (verdicts[k] for k in sorted(verdicts, key=lines.index))
    assert "0.00 MB (unbroken: 0.00 MB; the model: 1.01 MB)" in none and "equal to" in none
    assert "backward failed" in gather and "storage of size 0" in gather
    assert "allocated after forward: 1.01 MB" in free and "equal to the unbroken" in free


def _any_numbers(line):
    """A pattern for `line` with each number in it free to be another number."""
    parts = re.split(r"(\d[\d.e+-]*)", line)
    return "".join(r"[\d.e+-]+" if i % 2 else re.escape(part) for i, part in enumerate(parts))


def test_tp_breaks_show_their_damage(tmp_path):
    # 2 ranks: each break against stock's parallelize_module, measured (examples/break_tp.py).
    result = warm_torchrun(2, REPO / "examples" / "break_tp.py", "--break", "all",
                           "--grad-table", tmp_path / "btp.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines()  # less "gradient table: ..." lines
             if line.startswith(("--break", "    "))]
    verdicts = {line.split(":")[0]: nxt for line, nxt in zip(lines, lines[1:])
                if line.startswith("--break")}
    assert "equal to stock's after 3 steps, bit for bit" in verdicts["--break none"]
    every_rank = verdicts["--break bias-every-rank"]
    assert "parts from stock at step 0" in every_rank and "the bias is in it 2 times" in every_rank
    no_reduce = verdicts["--break no-input-allreduce"]
    assert "output off by 0 " in no_reduce and "embed.weight now differs between ranks" in no_reduce
    textbook = verdicts["--break bias-after"]
    assert "a different summation order" in textbook and "still the same on every rank" in textbook
    # The diff tool, given the textbook's gradient tables and stock's, names the cause.
    # docs/tp.md shows this run's output and the diff's figures: they are this run's.
    doc = (REPO / "docs" / "tp.md").read_text()
    for line in lines:
        if "a different summation order" in line:  # its digits are the CPU's kernels'
            assert re.search(_any_numbers(f"    {line}\n"), doc), f"docs/tp.md lacks: {line}"
        else:
            assert f"    {line}\n" in doc, f"docs/tp.md does not show: {line}"
    verdict = diff(tmp_path / "btp-bias-after-minddp.txt", tmp_path / "btp-bias-after-stock.txt")
    assert verdict.returncode == 1 and "different summation order" in verdict.stdout, verdict.stdout
    every = diff(tmp_path / "btp-bias-every-rank-minddp.txt",
                 tmp_path / "btp-bias-every-rank-stock.txt")
    units = re.search(r"by ([\d.]+) rounding units", every.stdout).group(1)
    assert f"by {units} rounding units" in doc, f"docs/tp.md's figure is not {units}"
    units = float(re.search(r"by ([\d.]+) rounding units", verdict.stdout).group(1))
    assert units <= 16, verdict.stdout  # the size of a summation order (the CPU's)
    assert "a bias added after a sum" in verdict.stdout and "NaiveDDP" not in verdict.stdout  # 2 ranks
    verdict = diff(tmp_path / "btp-none-minddp.txt", tmp_path / "btp-none-stock.txt")
    assert verdict.returncode == 0 and "IDENTICAL" in verdict.stdout, verdict.stdout


PP_HANGS = {name: ahead_torchrun(2, REPO / "examples" / "break_pp.py", "--break", name,
                                  "--timeout", "2") for name in ("deadlock", "v-on-loop")}


def test_pp_breaks_show_their_damage(tmp_path):
    # 2 stages against stock's ScheduleGPipe (examples/break_pp.py): the undivided loss is
    # named a factor of 4 (the microbatches) by the diff tool; a deadlocking order ends
    # within --timeout on both stages, each naming itself.
    script = REPO / "examples" / "break_pp.py"
    result = warm_torchrun(2, script, "--break", "loss-undivided", "--grad-table",
                           tmp_path / "b.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "outlived ddp_teardown" not in result.stdout  # the stages' own group is gone too
    for stage in (0, 1):
        assert f"stage {stage}: parts from stock at step 0" in result.stdout
        assert "gradients 4.000x stock's" in result.stdout
    verdict = diff(tmp_path / "b-minddp.txt", tmp_path / "b-stock.txt")
    assert verdict.returncode == 1 and "4.000x" in verdict.stdout, verdict.stdout
    # (each stage's rows hold NaN for the other stage's weights: the gap is still a number)
    assert re.search(r"by [\d.]+ rounding units", verdict.stdout), verdict.stdout
    result = PP_HANGS["deadlock"].result()
    assert result.returncode != 0
    # Both stages time out at about the same moment; torchrun stops the other worker as soon
    # as one has failed, so whether the second says so itself is a race: each stage that
    # speaks names itself, and at least one does.
    output = result.stdout + result.stderr
    named = [stage for stage in (0, 1) if f"[rank{stage}] error: stage {stage} of 2 (minddp)"
             f" stuck at step 0: Timed out" in output]
    assert named, output[-2000:]
    assert set(re.findall(r"exitcode\s*: (-?\d+)", result.stderr)) <= {"2", "-15"}, output[-2000:]
    # Two stages per rank, broken lists (minddp's zero-bubble runner): a W before its I is
    # refused at that W, on the last stage's rank, in one line; ZBV's order on a loop's
    # stages is a cycle (rank 0 waits for stage 3's gradient, rank 1 for stage 2's forward),
    # a hang both ranks name when --timeout runs out.
    result = warm_torchrun(2, script, "--break", "w-before-i")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "[rank1] error: stage 3: W0 before I0: the weights' gradients start from what I" \
           " kept" in output, output[-2000:]
    assert "rank 1 1F0 1F1 3F0 3W0 3I0" in output, output[-2000:]
    result = PP_HANGS["v-on-loop"].result()
    output = result.stdout + result.stderr
    assert result.returncode != 0
    named = [r for r, held in ((0, "0, 2"), (1, "1, 3")) if f"[rank{r}] error: stages {held} of"
             f" 4 (minddp) stuck at step 0: Timed out" in output]
    assert named, output[-2000:]
