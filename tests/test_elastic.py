"""Elastic training: checkpoints any world size loads, and a continuation with the same bits.

    pytest tests/test_elastic.py

On 4 spawned ranks (the suite's shared spawn): DDP (replicated AdamW), ZeRO-1 (minddp's and
stock's) and FSDP (minddp's and stock's fully_shard) each train, save a distributed
checkpoint at world size 4 and load it at 1, 2 and 3 (subgroups of the 4 ranks): the whole
weights and optimizer state `torch.equal` to what was saved, each FSDP rank holding exactly
the rows reshard_plan names. minddp's FSDP checkpoint loads into stock's fully_shard and
back. Trained with ordered_average, a run resized 4 -> 1, 2, 3 ends `torch.equal` to the run
never resized, for replicated AdamW and for ZeRO-1; stock DDP's and FSDP's drift is printed.
Without processes: the sampler's samples per step at any world size, the bad-input lines,
and a kill during save that leaves the previous checkpoint whole. Last, examples/elastic.py
for real: two torchrun agents (c10d rendezvous on loopback, --nnodes=1:2), node a training
alone, node b joining, then killed with its worker; node a finishes alone from the checkpoint
written at 2; the job's final weights and gradient table equal the 4-rank run's, which the
shared spawn ran.
"""

import atexit
import contextlib
import gc
import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DeviceMesh, DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import minddp
import minddp.run.cli
import minddp.tools.tables
from ahead import ahead
from helpers import (HANG_S, REPO, TAG, Silence, free_port, kill_tagged, launch_environ, share_spawn,
                     shared_results, stopped)
from minddp.launch.teardown import forget_dtensor_caches
from minddp.elastic.resize import (ElasticBatchSampler, check_world, ordered_average, reshard_plan,
                            set_gradients, shard_gradients, shard_rows)
from minddp.run.sharded_checkpoint import OPTIONS, latest, load_sharded, save_sharded

G, N, STEPS = 12, 12, 4  # global batch, virtual shards, steps (the checkpoint after step 2)
# 5 features: a sample is 20 bytes, so most shards start off a 64-byte boundary in every
# rank's batch, at another offset at every world size (a view's offset can change CPU bits).
FEATURES = 5
X = torch.linspace(-2, 2, FEATURES * G * STEPS).reshape(G * STEPS, FEATURES).sin()
Y = (X.sum(1) > 0).long() + (X[:, 0] > 0.5).long()
MODES = ["ddp", "zero", "stock_zero", "fsdp", "stock_fsdp"]


def _model(seed, mode, group):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 10), nn.ReLU(), nn.Linear(10, 3))  # 10 rows: uneven
    if mode == "fsdp":
        for layer in (model[0], model[2]):
            minddp.fully_shard(layer, process_group=group)
        minddp.fully_shard(model, process_group=group)
    elif mode == "stock_fsdp":
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
        for layer in (model[0], model[2]):
            stock_fully_shard(layer, mesh=mesh)
        stock_fully_shard(model, mesh=mesh)
    params = model.parameters()
    optimizer = (minddp.ShardedOptimizer(params, torch.optim.AdamW, process_group=group, lr=0.01)
                 if mode == "zero" else
                 ZeroRedundancyOptimizer(params, torch.optim.AdamW, process_group=group, lr=0.01)
                 if mode == "stock_zero" else torch.optim.AdamW(params, lr=0.01))
    return model, optimizer


def _train(model, optimizer, steps, group, reduce):
    """Steps `steps` of the global batches; reduce: "ordered", or the model's own (DDP, FSDP)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = G // world
    for step in steps:
        x, y = X[step * G:(step + 1) * G][rank * per:(rank + 1) * per], \
            Y[step * G:(step + 1) * G][rank * per:(rank + 1) * per]
        optimizer.zero_grad()
        if reduce == "ordered":
            rows, _ = shard_gradients(model, F.cross_entropy, x, y, N // world)
            set_gradients(model, ordered_average(rows, N, group))
        else:
            F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _whole(model, optimizer, group):
    """Every weight and optimizer entry, whole, by name: the same dict on every rank of group."""
    from minddp.run.sharded_checkpoint import _state
    state, _, _ = _state(model, optimizer)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"optim.{k}": v for k, v in state["optim"].items()})
    flat = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, flat, group=group)  # ZeRO: each rank names its own params
    whole = {}
    for theirs in everyone:
        for k, v in theirs.items():
            assert k not in whole or _same(whole[k], v), k  # replicated entries agree
            whole[k] = v
    return whole


def _same(a, b):
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _differences(a, b):
    """The keys whose values differ (or that only one holds), and the largest gap in weights."""
    keys = [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or not _same(a[k], b[k])]
    gap = max([(a[k] - b[k]).abs().max().item() for k in keys
               if k in a and k in b and k.startswith("model.")], default=0.0)
    return keys, gap


def _everything(rank, world_size, folder):
    subgroups = {k: dist.new_group(list(range(k))) for k in (1, 2, 3)}  # every rank creates each
    out = {"load": {}, "plan": {}, "continue": {}, "drift": {}, "interop": {}}
    for mode in MODES:
        path = os.path.join(folder, mode)
        reduce = "ordered" if mode in ("ddp", "zero", "stock_zero") else "own"
        model, optimizer = _model(0, mode, None)
        _train(model, optimizer, range(2), None, reduce)
        saved = _whole(model, optimizer, None)
        save_sharded(path, 2, model, optimizer, extra={"world_size": world_size})
        _train(model, optimizer, range(2, STEPS), None, reduce)
        unresized = _whole(model, optimizer, None)
        for k, group in [(4, None), *subgroups.items()]:
            if rank < k:
                # Another seed: only the load can make the weights equal.
                model, optimizer = _model(1, mode, group)
                info = load_sharded(path, model, optimizer, group=group)
                out["load"][mode, k] = (info["step"], _differences(_whole(model, optimizer, group),
                                                                   saved)[0])
                if mode == "fsdp" and k == 3:
                    out["plan"][rank] = _rows_read(model, path, rank)
                _train(model, optimizer, range(2, STEPS), group, reduce)
                out["continue" if reduce == "ordered" else "drift"][mode, k] = \
                    _differences(_whole(model, optimizer, group), unresized)
            dist.barrier()
    model, optimizer = _model(0, "ddp", None)  # stock DDP, resized: its drift
    ddp = DDP(model)
    _train(ddp, optimizer, range(2), None, "own")
    save_sharded(os.path.join(folder, "stock_ddp"), 2, ddp, optimizer)
    _train(ddp, optimizer, range(2, STEPS), None, "own")
    unresized = _whole(model, optimizer, None)
    del ddp
    for k, group in subgroups.items():
        if rank < k:
            model, optimizer = _model(1, "ddp", group)
            ddp = DDP(model, process_group=group)
            load_sharded(os.path.join(folder, "stock_ddp"), ddp, optimizer, group=group)
            _train(ddp, optimizer, range(2, STEPS), group, "own")
            out["drift"]["stock_ddp", k] = _differences(_whole(model, optimizer, group), unresized)
            del ddp
        dist.barrier()
    # minddp's FSDP checkpoint into stock's fully_shard at 2 ranks, stock's into minddp's at 3.
    for theirs, mine, k in (("fsdp", "stock_fsdp", 2), ("stock_fsdp", "fsdp", 3)):
        model, optimizer = _model(0, theirs, None)
        _train(model, optimizer, range(2), None, "own")
        saved = _whole(model, optimizer, None)
        if rank < k:
            model, optimizer = _model(1, mine, subgroups[k])
            load_sharded(os.path.join(folder, theirs), model, optimizer, group=subgroups[k])
            out["interop"][theirs, mine] = _differences(_whole(model, optimizer, subgroups[k]),
                                                        saved)[0]
        dist.barrier()
    out["example"] = _example_unresized(rank, folder)
    from argparse import Namespace
    from minddp.bench.elastic import elastic_size  # elastic-bench's measurement, one round
    out["bench"] = elastic_size("0.3M", Namespace(global_batch=48, virtual_shards=12, warmup=0,
                                                  rounds=1), rank, world_size, torch.device("cpu"))
    # The subgroups go now, not at the spawn's teardown: what held them (models, meshes) first.
    model = optimizer = ddp = None
    gc.collect()
    forget_dtensor_caches()
    dist.barrier()
    for group in subgroups.values():
        dist.destroy_process_group(group)
    return out


EXAMPLE_FLAGS = ["--reduce", "ordered"]  # its defaults: 4 epochs of 3 steps of 12 samples
STEPS_IN_EXAMPLE = 12
# A node silent for 30 heartbeats of 1 s is dead (torch's default: 3 of 5 s). Under load an
# agent falls silent for seconds; past the window, another agent drops it from its running
# round and forms a job of its own: the job parts in two (docs/elastic.md). Seen with 5 s at
# load average 29 on 2 cores; _resized stops node a's agent while b arrives to prove it.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=30"
SILENCE_S = 7  # how long node a's agent stays stopped once b's agent is in the rendezvous
SILENCE_MAX_S = 14  # ... at most, from its stop: well inside the window, even on a slow start


def _example_unresized(rank, folder):
    """examples/elastic.py's main() at 4 ranks, never resized: what it prints on this rank."""
    spec = importlib.util.spec_from_file_location("elastic_example", REPO / "examples/elastic.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # not __main__: nothing runs
    args = minddp.run.cli.lesson_parser(example.__doc__, elastic=True).parse_args(
        [*EXAMPLE_FLAGS, "--checkpoint-dir", os.path.join(folder, f"example"),
         "--grad-table", os.path.join(folder, "whole.txt")])
    env = minddp.DDPEnv(rank=rank, local_rank=rank, world_size=4, backend="gloo",
                        device=torch.device("cpu"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.main(env, args)
        args.global_batch = 24  # resumed with another global batch: refused, every rank alike
        try:
            example.main(env, args)
        except minddp.UsageError as said:
            return printed.getvalue(), str(said)
    return printed.getvalue(), None


def _rows_read(model, path, rank):
    """(rows this rank holds of the first weight, the rows the saved blocks hold, plan, local)."""
    chunks = dcp.FileSystemReader(latest(path)).read_metadata().state_dict_metadata["model.0.weight"].chunks
    saved_blocks = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks)
    return (shard_rows(10, 3, rank), saved_blocks, reshard_plan(10, 4, 3, rank),
            model[0].weight.to_local().clone())


FOLDER = tempfile.mkdtemp(prefix="minddp-elastic-")  # the checkpoints: every rank writes
atexit.register(shutil.rmtree, FOLDER, True)
share_spawn(_everything, [4], FOLDER)


def _results():
    return shared_results(_everything, 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_saved_at_4_loads_at_any_world_size(mode, k):
    for rank in range(k):  # every rank of the smaller group holds the whole saved state
        step, differing = _results()[rank]["load"][mode, k]
        assert step == 2 and differing == [], (rank, differing)


def test_fsdp_ranks_read_the_rows_reshard_plan_names():
    results = _results()
    whole = torch.cat([results[r]["plan"][r][3] for r in range(3)])
    for rank in range(3):
        (start, stop), saved_blocks, plan, local = results[rank]["plan"][rank]
        # Saved at 4: the blocks of 10 rows are 3, 3, 3, 1 (torch.chunk's), stamped with offsets.
        assert saved_blocks == [(0, 3), (3, 6), (6, 9), (9, 10)]
        assert plan[0][1] == start and plan[-1][2] == stop  # the pieces cover our rows, in order
        assert all(a[2] == b[1] for a, b in zip(plan, plan[1:]))
        assert torch.equal(local, whole[start:stop])
    assert [p for r in range(3) for p in results[r]["plan"][r][2]] == \
        [(0, 0, 3), (1, 3, 4), (1, 4, 6), (2, 6, 8), (2, 8, 9), (3, 9, 10)]


@pytest.mark.parametrize("mode", ["ddp", "zero", "stock_zero"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ordered_continuation_at_any_world_size_equals_the_unresized_run(mode, k):
    for rank in range(k):
        differing, gap = _results()[rank]["continue"][mode, k]
        assert differing == [] and gap == 0.0, (rank, differing, gap)


@pytest.mark.parametrize("mode", ["stock_ddp", "fsdp", "stock_fsdp"])
def test_an_all_reduce_resized_drifts_and_says_how_far(mode, capsys):
    drift = {k: _results()[0]["drift"][mode, k] for k in ((1, 2, 3) if mode == "stock_ddp"
                                                          else (1, 2, 3, 4))}
    if 4 in drift:  # resumed at the same world size: exact, so any drift is the resize's
        assert drift[4] == ([], 0.0)
    with capsys.disabled():
        print(f"\n{mode}: max |weight - unresized| after {STEPS - 2} steps: " +
              ", ".join(f"4 -> {k}: {gap:.1e}" for k, (_, gap) in drift.items()))
    assert all(gap < 1e-5 for _, gap in drift.values())  # rounding, not another computation


def test_fsdp_checkpoints_open_in_stock_fully_shard_and_back():
    results = _results()
    for rank in range(2):
        assert results[rank]["interop"]["fsdp", "stock_fsdp"] == []
    for rank in range(3):
        assert results[rank]["interop"]["stock_fsdp", "fsdp"] == []


def test_each_shard_s_gradient_is_computed_on_a_tensor_of_its_own():
    """The model sees every shard as a fresh tensor (offset 0, a 64-byte aligned start), never
    as a view into the rank's batch, and the rows equal each shard's gradient on a copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 14), nn.Tanh(), nn.Linear(14, 3))
    seen = []
    model[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    x, y = X[1:1 + G], Y[1:1 + G]  # a batch that itself starts off a boundary
    rows, losses = shard_gradients(model, F.cross_entropy, x, y, 6)
    assert len(seen) == 6
    for shard, copy in zip(seen, x.chunk(6)):
        assert shard.storage_offset() == 0 and shard.data_ptr() % 64 == 0
        assert shard.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert torch.equal(shard, copy)
    for row, xs, ys in zip(rows, x.chunk(6), y.chunk(6)):
        grads = torch.autograd.grad(F.cross_entropy(model(xs.clone()), ys.clone()),
                                    list(model.parameters()))
        assert torch.equal(row, torch.cat([g.reshape(-1) for g in grads]))


def test_the_samples_of_a_step_do_not_depend_on_the_world_size():
    order = list(DistributedSampler(range(40), num_replicas=1, rank=0, seed=5).__iter__())
    for epoch_start in (0, 2):
        batches = {}
        for world in (1, 2, 3, 4, 6):
            steps = []
            for rank in range(world):
                sampler = ElasticBatchSampler(40, G, world, rank, seed=5)
                sampler.set_epoch(0, start_step=epoch_start)
                steps.append(list(sampler))
            assert all(len(s) == 3 - epoch_start for s in steps)
            # Rank r's samples: the r-th run of G / world samples of the step's global batch.
            batches[world] = [sum((steps[r][i] for r in range(world)), [])
                              for i in range(3 - epoch_start)]
        assert all(b == batches[1] for b in batches.values())
        assert batches[1] == [order[s * G:(s + 1) * G] for s in range(epoch_start, 3)]


def test_the_docs_final_weights_are_the_examples():
    # docs/elastic.md shows a run resized 4 -> 2 -> 4 with --reduce ordered: its final weights
    # are the run never resized, this one (the same sha1: the figure is checked, not copied).
    printed = _results()[0]["example"][0]
    final = re.search(r"final weights after step 12: sha1 \w+", printed).group(0)
    assert final in (REPO / "docs" / "elastic.md").read_text(), final


def test_resuming_with_another_global_batch_is_refused():
    for rank in range(4):
        said = _results()[rank]["example"][1]
        assert said is not None and said.startswith("the checkpoint in ") and said.endswith(
            "was written with --global-batch 12, this run has 24 (hint: resume with"
            " --global-batch 12, or another --checkpoint-dir)"), said


def test_bad_input_is_one_line():
    with pytest.raises(minddp.UsageError, match="a global batch of 12 cannot be kept at world"
                                                " size 5"):
        check_world(12, 5)
    with pytest.raises(minddp.UsageError, match="8 virtual shards cannot be dealt to 3 ranks"):
        check_world(12, 3, 8)
    with tempfile.TemporaryDirectory() as folder:  # one process, no group: DCP saves alone
        small = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 3))
        save_sharded(folder, 1, small, torch.optim.AdamW(small.parameters()))
        other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        with pytest.raises(minddp.UsageError) as said:
            load_sharded(folder, other, torch.optim.AdamW(other.parameters()))
        assert "does not fit this model: it saved '0.bias' with shape [10], this model's is" \
               " [16]" in str(said.value)
        assert "\n" not in str(said.value)


SAVER = """
import sys, time, torch
from minddp.run.sharded_checkpoint import save_sharded
model = torch.nn.Linear(2000, 2000)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 1000):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)  # a checkpoint's weights say which step wrote it
    save_sharded(sys.argv[1], step, model, optimizer)
    print(step, flush=True)
"""


def test_a_kill_during_save_leaves_the_previous_checkpoint_whole():
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen([sys.executable, "-c", SAVER, folder], cwd=REPO,
                                stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + HANG_S
        try:  # kill it while a save after the second is being written (a checkpoint's
            # .partial folder: latest.partial is there for a moment while step 2 is named)
            while not (os.path.exists(os.path.join(folder, "step-000002")) and
                       any(n.startswith(".step-") for n in os.listdir(folder))):
                assert proc.poll() is None and time.monotonic() < deadline, "the saver stopped"
                time.sleep(0.001)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        model = torch.nn.Linear(2000, 2000)
        info = load_sharded(folder, model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert info["step"] >= 2
        assert all(bool((p == info["step"]).all()) for p in model.parameters())


def _resized(tmp):
    """Node a trains step 1 alone, node b joins before step 2, dies after it (agent and
    worker killed), and node a trains steps 3-12 alone, from step 2's checkpoint. A hold file
    gates the steps (examples/elastic.py --hold-file), so each event lands at a known step
    however fast the machine. (a's exit status, a's output, b's output, the folder)"""
    folder, port = str(tmp), free_port()
    hold = os.path.join(folder, "hold")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={os.getpid()}",
                "--max-restarts=3", "--monitor-interval=0.5", "examples/elastic.py", *EXAMPLE_FLAGS, "--hold-file", hold,
                "--checkpoint-dir", os.path.join(folder, "ck"),
                "--grad-table", os.path.join(folder, "elastic.txt")]
    # torch 2.13's agents share one TCP store across rendezvous rounds; a node that joins a
    # later round then waits forever for its address (docs/elastic.md).
    # LOGLEVEL=INFO: each agent logs its rendezvous (read by silent(), shown on a failure).
    env = dict(launch_environ(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO")
    # The bound is on silence: beside the suite and two busy loops (load 32) a run took 389 s,
    # each line late but none missing; a hang writes nothing (helpers.Silence).
    agents = {}
    silence = Silence([os.path.join(folder, f"{name}.log") for name in "ab"])

    def start(name):
        log = open(os.path.join(folder, f"{name}.log"), "w")
        tag = f"{os.getpid()}-{name}-{time.monotonic_ns()}"
        # Node a hosts the rendezvous store (is_host), which must outlive node b: on many
        # machines, the one at --rdzv-endpoint.
        conf = f"{RDZV_CONF},is_host={int(name == 'a')}"
        agents[name] = (subprocess.Popen([*launcher[:3], f"--rdzv-conf={conf}", *launcher[3:]],
                                         cwd=REPO, env={**env, TAG: tag}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         stdin=subprocess.DEVNULL), tag, log)

    def log(name):
        if name not in agents:
            return ""
        with open(os.path.join(folder, f"{name}.log")) as f:
            return f.read()

    def wait_for(names, pattern):
        while not any(re.search(pattern, log(name)) for name in names):
            assert not re.search(r"\[rank0\] world size 1", log("b")), \
                "node b formed a job of its own beside a's (the job parted in two):\n" + \
                "\n".join(f"--- agent {n}:\n{log(n)[-4000:]}" for n in agents)
            for name in names:
                assert agents[name][0].poll() is None, f"agent {name} ended:\n{log(name)[-3000:]}"
            assert not silence.expired() and not stopped(), \
                f"still waiting for {pattern!r} ({silence}: a hang?), or the session ended\n" + \
                "\n".join(f"--- agent {n}:\n{log(n)[-4000:]}" for n in agents)
            time.sleep(0.1)

    def wait_for_checkpoint(step):
        while latest(os.path.join(folder, "ck")) != os.path.join(folder, "ck", f"step-{step:06d}"):
            assert agents["a"][0].poll() is None and not silence.expired() \
                and not stopped(), log("a")
            time.sleep(0.1)

    def silent(agent, then):
        """Stop the agent (SIGSTOP: its heartbeats stop, as on a starved machine), run then(),
        and let it go on once b's agent has spent SILENCE_S in the rendezvous."""
        stop = time.monotonic()
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            then()
            end = stop + SILENCE_MAX_S
            while time.monotonic() < end and "Rendezvous'ing worker group" not in log("b"):
                time.sleep(0.1)
            time.sleep(max(0.0, min(end, time.monotonic() + SILENCE_S) - time.monotonic()))
        finally:
            os.kill(agent.pid, signal.SIGCONT)

    def allow(step):
        with open(hold + ".partial", "w") as f:
            f.write(f"{step}\n")
        os.replace(hold + ".partial", hold)  # read whole or not at all

    try:
        allow(1)
        start("a")  # alone: once the rendezvous has waited 1 s for more, world size 1
        wait_for(["a"], r"\[rank0\] step 001 \| world size 1")
        wait_for_checkpoint(1)
        silent(agents["a"][0], lambda: start("b"))  # b finds a's heartbeat seconds old
        # a's agent sees a node waiting and restarts its worker at world size 2
        wait_for(["a", "b"], r"\[rank1\] world size 2: takes samples 6..11")
        allow(2)
        wait_for_checkpoint(2)  # step 2, at world size 2, saved whole
        kill_tagged(agents["b"][1])  # node b is gone: its agent and its worker, at once
        allow(STEPS_IN_EXAMPLE)  # a's worker meets b's absence in step 3's first collective
        proc = agents["a"][0]
        while proc.poll() is None:
            assert not silence.expired() and not stopped(), \
                f"agent a still running ({silence}: a hang?), or the session ended\n" + \
                "\n".join(f"--- agent {n}:\n{log(n)[-4000:]}" for n in agents)
            time.sleep(0.1)
    finally:
        for proc, tag, out in agents.values():
            kill_tagged(tag)
            proc.wait()
            out.close()
    return agents["a"][0].returncode, log("a"), log("b"), folder


RESIZED = ahead(_resized)


def test_two_torchrun_agents_one_joins_then_is_lost_and_the_job_finishes_smaller():
    """A node joins a running job, then leaves (agent and worker killed); the job finishes
    alone (_resized, run ahead of this test: conftest)."""
    whole = _results()[0]["example"][0]  # the run never resized: 4 ranks, the same 12 steps
    code, a, b, folder = RESIZED.result()
    assert code == 0, a[-3000:]
    assert "[rank0] world size 1: takes samples 0..11 of each global batch of 12" in a
    assert "resuming after step 1: saved at world size 1, now 2" in a + b
    assert "[rank1] world size 2: takes samples 6..11 of each global batch of 12" in a + b
    assert "resuming after step 2: saved at world size 2, now 1" in a
    final = re.findall(r"final weights after step 12: sha1 \w+", a)
    assert final and final == re.findall(r"final weights after step 12: sha1 \w+", whole), a
    meta, _ = minddp.tools.tables.read_table(os.path.join(folder, "elastic.txt"))
    assert meta["world_sizes"] == [1, 2] + [1] * 10  # one table across the resizes
    diff = subprocess.run([sys.executable, "-m", "minddp", "diff", os.path.join(folder, "elastic.txt"),
                           os.path.join(FOLDER, "whole.txt")], capture_output=True, text=True)
    assert diff.returncode == 0 and "IDENTICAL" in diff.stdout, diff.stdout


def test_elastic_bench_counts_the_ordered_reductions_bytes(capsys):
    rows = _results()[0]["bench"]
    assert [r[2] for r in rows] == ["stock DDP", "BucketedDDP", "ordered"]
    # A rank passes every gradient to one all_reduce; ordered: to a send and a broadcast.
    assert [r[4] for r in rows] == ["1.00x", "1.00x", "2.00x"]
    assert all(float(r[5]) > 0 for r in rows)
    from minddp.bench.elastic import main, parse
    with pytest.raises(SystemExit) as exited:  # refused before any rank starts
        main(parse(["--world-sizes", "5"]))
    said = capsys.readouterr().err
    assert exited.value.code == 2 and said.count("error: a global batch of 96 cannot be kept at"
                                                 " world size 5") == 1, said


def test_the_diff_names_a_resize_as_the_summation_order(tmp_path, capsys):
    import numpy as np
    from minddp.tools.diff import main as diff
    from minddp.tools.tables import write_table
    grads = [np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3) * (s + 1) for s in range(4)]
    nudged = [g.copy() for g in grads]
    nudged[2][0, 0] = np.nextafter(grads[2][0, 0], np.float32(2))  # one ulp, from step 2 on
    nudged[3] = grads[3] * np.float32(1 + 2 ** -22)
    for name, rows, sizes in (("a", grads, [4, 4, 4, 4]), ("b", nudged, [4, 4, 3, 3])):
        write_table(str(tmp_path / name), [[(s, 0, {"w": g}) for s, g in enumerate(rows)]],
                    world_sizes=sizes)
    assert diff([str(tmp_path / "b"), str(tmp_path / "a")]) == 1
    said = capsys.readouterr().out
    assert "world size per step 4 4 3 3 (A), 4 4 4 4 (B)" in said
    assert ("the size of a different summation order, not of a wrong gradient: from step 2 A"
            " reduced over 3 ranks and B over 4") in said
