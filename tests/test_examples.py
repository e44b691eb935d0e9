"""End to end: the examples under torchrun and plain python, their tables, the lesson's numbers.

    pytest tests/test_examples.py
"""

import json
import re
import subprocess
import sys

import pytest

from ahead import ahead, ahead_run, ahead_torchrun
from helpers import REPO, cli, run, torchrun, warm_torchrun

STOCK, MANUAL = REPO / "examples" / "stock_ddp.py", REPO / "examples" / "manual_ddp.py"
ACCUMULATE = REPO / "examples" / "accumulate.py"
LESSON = REPO / "tests" / "reference" / "lesson_ddp_script.py"
STEP_LINE = re.compile(r"\[(?:GPU|rank)(\d+)\] Epoch: (\d+)/\d+ \| Batchsize (\d+) \| Train/Val Loss: ([0-9.]+)")


def losses(output):
    """{rank: [loss strings in step order]} from the step lines (ranks' lines may interleave)."""
    by_rank = {}
    for rank, _, batch, loss in STEP_LINE.findall(output):
        by_rank.setdefault(int(rank), []).append(loss)
    return by_rank


def diff(a, b, *extra):
    return cli("diff", a, b, *extra)  # in this process (test_ddp.py runs the command)


@pytest.mark.parametrize("nproc", [1, 2])
def test_manual_and_stock_tables_are_identical(launch, nproc):
    (_, stock), (_, manual) = launch(STOCK, nproc), launch(MANUAL, nproc)
    verdict = diff(manual, stock)
    assert verdict.returncode == 0, verdict.stdout
    assert "verdict: IDENTICAL" in verdict.stdout
    assert f"world size {nproc}, {6 // nproc} steps, 6 parameters" in verdict.stdout


def test_three_processes_identical_too(launch):
    # At 3 ranks the order of the additions matters; buckets laid out as stock lays
    # them out make ManualDDP add in stock's order (NaiveDDP does not: test_ddp.py).
    (_, stock), (_, manual) = launch(STOCK, 3, "--epochs", "1"), launch(MANUAL, 3, "--epochs", "1")
    verdict = diff(manual, stock)
    assert verdict.returncode == 0, verdict.stdout
    assert "verdict: IDENTICAL" in verdict.stdout


def test_gradient_accumulation_matches_stock(launch):
    # Its defaults, as its docstring runs it: 20 examples, 2 ranks: 5 micro-batches per rank
    # and epoch, K=2 -> steps of 2, 2 and 1 micro-batches, 3 steps per epoch (not 5).
    (_, stock), (run_, manual) = launch(ACCUMULATE, 2, "--ddp", "stock"), launch(ACCUMULATE, 2)
    verdict = diff(manual, stock)
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout
    assert "world size 2, 9 steps, 6 parameters" in verdict.stdout
    assert len(losses(run_.stdout)[0]) == 9  # a line per optimizer step: 15 micro-batches


def test_zero1_example_equals_zero_redundancy_optimizer_and_shards_adamws_state(launch):
    zero1 = REPO / "examples" / "zero1.py"
    (result, manual), (_, stock) = launch(zero1, 2), launch(zero1, 2, "--zero", "stock")
    verdict = diff(manual, stock)
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout
    # Each rank holds AdamW's state for its own parameters only, and together all of them.
    held = re.findall(r"\[rank(\d)\] AdamW state for (\d) of 6 parameters \(([^)]*)\): ([0-9.]+) KiB",
                      result.stdout)
    assert sorted(r for r, *_ in held) == ["0", "1"], result.stdout
    names = [n for *_, names, _ in held for n in names.split(", ")]
    assert sorted(names) == sorted(set(names)) and len(names) == 6  # each once, none missing
    assert all(float(kib) > 0 for *_, kib in held)


def test_tp_example_equals_parallelize_module(launch):
    tp = REPO / "examples" / "tp.py"
    (result, manual), (stock_result, stock) = launch(tp, 2), launch(tp, 2, "--tp", "stock")
    verdict = diff(manual, stock)  # whole gradients, gathered from each rank's slices
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout
    assert "world size 2, 6 steps, 6 parameters" in verdict.stdout  # all 5 examples, each rank
    assert losses(result.stdout) == losses(stock_result.stdout)
    (_, alone), (_, lesson) = launch(tp, 1), launch(MANUAL, 1)  # one rank: nothing to split
    verdict = diff(alone, lesson)
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout


def test_pipeline_example_equals_torch_distributed_pipelining(launch):
    pipeline = REPO / "examples" / "pipeline.py"
    # minddp's 1F1B against stock's GPipe: another order, the same arithmetic (each schedule
    # against stock's own, and the order, are in test_pp.py).
    (result, manual), (stock_result, stock) = launch(pipeline, 2), \
        launch(pipeline, 2, "--pp", "stock", "--schedule", "gpipe")
    verdict = diff(manual, stock)  # each rank's own stage; the other stage's rows NaN on both
    assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout
    assert "world size 2, 15 steps, 6 parameters" in verdict.stdout  # 20 examples, batches of 4
    ours = losses(result.stdout)  # the last stage prints each batch's loss
    assert ours == losses(stock_result.stdout) and list(ours) == [1] and len(ours[1]) == 15
    # 1F1B at 2 stages, 2 microbatches: the first stage warms up with both forwards.
    assert "[rank0] stage 0, 1f1b: F0 F1 B0 B1" in result.stdout
    assert "[rank1] stage 1, 1f1b: F0 B0 F1 B1" in result.stdout


def test_fsdp_example_equals_stock_fully_shard_and_stock_ddp(launch):
    fsdp = REPO / "examples" / "fsdp.py"
    (result, manual), (_, stock_fsdp) = launch(fsdp, 2), launch(fsdp, 2, "--fsdp", "stock")
    (stock_result, stock_ddp) = launch(STOCK, 2)
    for other in (stock_fsdp, stock_ddp):  # whole gradients, gathered from the shards
        verdict = diff(manual, other)
        assert verdict.returncode == 0 and "verdict: IDENTICAL" in verdict.stdout, verdict.stdout
    assert losses(result.stdout) == losses(stock_result.stdout)  # the lesson's losses


TRACED = ahead(lambda tmp: torchrun(2, MANUAL, "--grad-table", tmp / "traced.txt",
                                     "--timeline", tmp / "t.json"))


def test_timeline_recording_changes_no_gradient(launch):
    # The real torchrun, beside the warm workers `launch` forks (helpers.warm_torchrun): the
    # same gradients, bit for bit, and the same lines printed, the table's own line apart.
    (warm, plain) = launch(MANUAL, 2)
    result, tmp_path = TRACED.result(), TRACED.tmp
    traced = tmp_path / "traced.txt"
    assert result.returncode == 0, result.stderr[-2000:]
    assert "verdict: IDENTICAL" in diff(traced, plain).stdout
    printed = [sorted(line for line in run_.stdout.splitlines()
                      if not line.startswith(("gradient table:", "timeline:")))
               for run_ in (result, warm)]
    assert printed[0] == printed[1] and len(printed[0]) >= 9, printed
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e["name"] == "bucket 0" for e in events)


def test_diff_finds_a_run_with_another_seed(launch):
    (_, stock), (_, other) = launch(STOCK, 2), launch(MANUAL, 2, "--seed", "7")
    verdict = diff(other, stock)
    assert verdict.returncode == 1, verdict.stdout
    assert "verdict: DIFFERENT" in verdict.stdout
    assert "more than rounding" in verdict.stdout


LESSONS = {nproc: ahead_torchrun(nproc, LESSON) for nproc in (1, 2)}


@pytest.mark.parametrize("nproc", [1, 2])
def test_losses_equal_the_lessons_script(launch, nproc):
    # The lesson's own script ends with destroy_process_group() while stock DDP's reducer
    # still holds the group: how its process then ends is torch's, so torchrun runs it. On
    # a loaded machine a worker may abort after its last line (std::terminate on a thread of
    # the freed group, SIGABRT): torch's exit, not the lesson's numbers, which are compared
    # either way (every loss printed, below).
    lesson = LESSONS[nproc].result()
    aborted = ("terminate called without an active exception" in lesson.stderr
               and "(exitcode: -6)" in lesson.stderr)
    assert lesson.returncode == 0 or aborted, lesson.stderr
    expected = losses(lesson.stdout)
    assert sorted(expected) == list(range(nproc)) and all(len(v) == 6 // nproc for v in expected.values())
    for script in (STOCK, MANUAL):
        result, _ = launch(script, nproc)
        assert losses(result.stdout) == expected, script.name


def test_accuracy_is_printed_once_and_global(launch):
    result, _ = launch(MANUAL, 2)
    assert result.stdout.count("Training accuracy") == 1
    assert "Training accuracy 1.0" in result.stdout and "Test accuracy 1.0" in result.stdout


PLAIN = {script: ahead(lambda tmp, script: run([sys.executable, str(script), "--grad-table",
                                                  tmp / "plain.txt"]), script)
         for script in (STOCK, MANUAL)}


@pytest.mark.parametrize("script", [STOCK, MANUAL], ids=["stock", "manual"])
def test_plain_python_runs_as_world_size_one(launch, script):
    result, table = PLAIN[script].result(), PLAIN[script].tmp / "plain.txt"
    assert result.returncode == 0, result.stderr
    assert "world size 1" in result.stdout
    assert diff(table, launch(STOCK, 1)[1]).returncode == 0  # the same run as torchrun's


def test_examples_differ_only_where_ddp_differs():
    out = subprocess.run(["diff", str(STOCK), str(MANUAL)], capture_output=True, text=True).stdout
    changed = [line[2:] for line in out.splitlines() if line[:2] in ("< ", "> ")]
    assert len(changed) == 8  # the 2 imports, the sampler and the wrapper, on each side
    assert all(re.search(r"Sampler|DDP", line) for line in changed), changed
    for script in (STOCK, MANUAL):
        assert len(script.read_text().splitlines()) <= 75, script.name  # lesson-sized


NCCL = ahead_torchrun(2, MANUAL, "--backend", "nccl")


def test_nccl_without_cuda_fails_fast_with_a_hint():  # the helpers hide any GPU
    result = NCCL.result()
    assert result.returncode != 0
    assert result.stderr.count("error: nccl needs CUDA") == 1  # said once, not once per rank
    assert "---> HINT:" in result.stderr


def test_zero_batches_fails_fast_and_the_hint_works():
    # The lesson's numbers: 6 ranks share 5 examples, 1 each, under one batch of 2.
    result = warm_torchrun(6, MANUAL, "--epochs", "1")
    assert result.returncode != 0
    assert result.stderr.count("error: each rank gets 1 example(s) of 5 at world size 6") == 1
    assert "--factor" in result.stderr
    # The hint works: with --factor 4, 20 examples give each of 6 ranks at least one batch
    # (the loader manual_ddp.py builds, checked here without starting 6 more processes).
    from torch.utils.data import DataLoader
    from minddp import ShardSampler, check_batches, toy_datasets
    train_ds, _ = toy_datasets(4)
    for rank in range(6):
        loader = DataLoader(train_ds, batch_size=2, drop_last=True,
                            sampler=ShardSampler(train_ds, num_replicas=6, rank=rank))
        check_batches(loader, 6)
        assert len(loader) >= 1


SINGLE = ahead_run([sys.executable, str(REPO / "examples" / "single_device.py"), "--device", "cpu"])
DEVICES = ahead_run([sys.executable, str(REPO / "examples" / "devices.py")])


def test_single_device_prints_the_lessons_numbers():
    result = SINGLE.result()
    assert result.returncode == 0, result.stderr
    assert re.findall(r"Train Loss: ([0-9.]+)", result.stdout) == ["0.75", "0.65", "0.44", "0.13", "0.03", "0.00"]


def test_devices_explains_the_mixed_device_error():
    result = DEVICES.result()
    assert result.returncode == 0, result.stderr
    assert "tensor([5., 7., 9.])" in result.stdout
    assert "RuntimeError" in result.stdout and "the fix" in result.stdout


def test_diff_tool_on_a_missing_table_exits_2_with_one_line(launch, tmp_path):
    result = diff(tmp_path / "missing.txt", launch(STOCK, 1)[1])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0] == f"minddp diff: cannot read {tmp_path / 'missing.txt'}: no such file"
    assert len(result.stderr.splitlines()) == 2 and "Traceback" not in result.stderr
