"""Failures, end to end: crash and resume, two torchrun agents, the timeout, wrong setups.

    pytest tests/test_faults.py
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import torch

from ahead import ahead, ahead_run
from helpers import (HANG_S, REPO, TAG, Silence, cli, free_port, kill_tagged, launch_environ,
                     run_ranks, share_spawn, shared_results, stopped, torchrun)
from minddp import (GradTable, ManualDDP, NaiveDDP, NeuralNetwork, UsageError, load_checkpoint,
                    save_checkpoint)
import minddp.run.checkpoint

MANUAL, RESTART = REPO / "examples" / "manual_ddp.py", REPO / "examples" / "restart.py"
STUCK = REPO / "tests" / "scripts" / "stuck_peer.py"


def diff(a, b):
    return cli("diff", a, b)  # in this process (test_ddp.py runs the command)


def weights(checkpoint):
    return torch.load(checkpoint, weights_only=True)["state"]["model"]


COMMON = ["--factor", "2", "--epochs", "3"]


WHOLE = ahead(lambda tmp: torchrun(2, RESTART, *COMMON, "--checkpoint", tmp / "a.pt",
                                   "--grad-table", tmp / "a.txt"))


@pytest.fixture(scope="module")
def uninterrupted():
    """One run never crashed (BucketedDDP); stock DDP's equals it bit for bit (test_examples)."""
    whole = WHOLE.result()
    assert whole.returncode == 0, whole.stderr
    return WHOLE.tmp


def _crashed(tmp, ddp):
    """(the run that crashed at step 4 and restarted, the seconds it took)"""
    t0 = time.monotonic()
    crashed = torchrun(2, RESTART, "--ddp", ddp, *COMMON, "--checkpoint", tmp / "b.pt",
                       "--grad-table", tmp / "b.txt", "--crash-at-step", "4",
                       launcher=["--max-restarts=1"])
    return crashed, time.monotonic() - t0


CRASHED = {ddp: ahead(_crashed, ddp) for ddp in ("manual", "stock")}


@pytest.mark.parametrize("ddp", ["manual", "stock"])
def test_crash_and_restart_resumes_bit_for_bit(ddp, uninterrupted):
    # --factor 2: 10 examples, 2 steps per epoch, 6 in all; rank 1 dies as step 4 begins,
    # in the middle of epoch 2, so the restart replays epoch 2 from the epoch-1 checkpoint.
    (crashed, elapsed), tmp_path = CRASHED[ddp].result(), CRASHED[ddp].tmp
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "[rank1] --crash-at-step 4: exiting abruptly" in crashed.stdout
    assert crashed.stdout.count("PyTorch ") == 2  # rank 0's header, once per attempt
    # The restart says, once, where it resumes: after epoch 1 (2 steps), on attempt 1.
    resumed = f"resuming from {tmp_path / 'b.pt'}: epoch 2, after step 2 (torchrun attempt 1)"
    assert crashed.stdout.count(resumed) == 1, crashed.stdout
    verdict = diff(tmp_path / "b.txt", uninterrupted / "a.txt")
    assert verdict.returncode == 0 and "IDENTICAL" in verdict.stdout, verdict.stdout
    a, b = weights(uninterrupted / "a.pt"), weights(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"crash + restart + resume: {elapsed:.1f} s")


def test_interrupted_save_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    model = NeuralNetwork(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    table = GradTable(model, None)
    save_checkpoint(path, epoch=0, step=1, model=model, optimizer=optimizer, grad_table=table)
    before, saved_weight = open(path, "rb").read(), model.layers[0].weight.clone()

    def dies_mid_write(obj, f):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a checkpoint")  # then the process is gone
        raise KeyboardInterrupt

    monkeypatch.setattr(minddp.run.checkpoint.torch, "save", dies_mid_write)
    with torch.no_grad():
        model.layers[0].weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, epoch=1, step=2, model=model, optimizer=optimizer, grad_table=table)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    fresh = NeuralNetwork(2, 2)
    epoch, step = load_checkpoint(path, "cpu", model=fresh, grad_table=table, optimizer=torch.optim.SGD(
        fresh.parameters(), lr=0.5, momentum=0.9))
    assert (epoch, step) == (1, 1)
    assert torch.equal(fresh.layers[0].weight, saved_weight)


def test_damaged_checkpoint_is_one_clear_error(tmp_path):
    path = tmp_path / "ck.pt"
    path.write_bytes(b"not a checkpoint")
    model = NeuralNetwork(2, 2)
    with pytest.raises(UsageError, match="not a minddp checkpoint"):
        load_checkpoint(str(path), "cpu", model=model)
    # A real checkpoint cut short (a full disk, a copy interrupted): the file is named and
    # the reason is a whole sentence, never cut mid-word.
    save_checkpoint(str(path), epoch=0, step=1, model=model)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(UsageError) as err:
        load_checkpoint(str(path), "cpu", model=model)
    message = err.value.message
    assert message.startswith(f"cannot resume from {path}: it is damaged or not a minddp"
                              " checkpoint (RuntimeError: "), message
    assert message.endswith(")") and "interna)" not in message, message


def _two_agents(rendezvous, table, timeout=HANG_S):
    """Two torchrun agents on this machine, one process each: a 2-node job in miniature.
    Bounded on silence (helpers.Silence); one agent failed ends both at once, since the other
    would wait for it until the rendezvous' own timeout (15 min)."""
    tag, procs, outputs = uuid.uuid4().hex, [], []
    env = dict(launch_environ(), OMP_NUM_THREADS="1", **{TAG: tag})  # their workers carry it too
    with tempfile.TemporaryDirectory() as tmp:
        for node_rank in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc_per_node=1", *rendezvous(node_rank), str(MANUAL),
                   "--grad-table", str(table)]
            files = [open(os.path.join(tmp, f"{node_rank}.{s}"), "w+") for s in ("out", "err")]
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=files[0],
                                           stderr=files[1], start_new_session=True), files))
        silence, hung = Silence([f for _, files in procs for f in files], timeout), False
        try:
            while any(p.poll() is None for p, _ in procs) and not hung:
                if any(p.poll() not in (None, 0) for p, _ in procs):
                    break  # the other waits for it: the outputs say why
                hung = silence.expired() or stopped()
                time.sleep(0.1)
        finally:
            kill_tagged(tag)  # agents and workers (each in a session of its own), orphans too
        for p, files in procs:  # read once all are gone: nothing writes while it is read
            for f in files:
                f.seek(0)
            outputs.append((p.wait(), files[0].read(), files[1].read()))
            for f in files:
                f.close()
    if hung:
        raise AssertionError(f"two-agent run still going after {silence} (a hang?), or at the"
                             " session's end\n" + "\n".join(
                                 f"--- node {n} {s}:\n{text[-3000:]}"
                                 for n, (_, *texts) in enumerate(outputs)
                                 for s, text in zip(("out", "err"), texts)))
    return outputs


@pytest.fixture(scope="module")
def one_agent_table(launch):
    return launch(MANUAL, 2)[1]  # the same run test_examples.py compares with stock's


def _agents(tmp, how, ports=None):
    for port in ports or (free_port() for _ in range(3)):
        outputs = _agents_at(port, tmp, how)
        # free_port() lets the port go before node 0's store takes it; on a busy machine
        # another process may take it first (EADDRINUSE): another port then, not a failure.
        if not any("EADDRINUSE" in err for code, out, err in outputs if code):
            break
    return outputs


def _agents_at(port, tmp, how):
    if how == "static":  # node 0 hosts the store at MASTER_ADDR:MASTER_PORT
        rendezvous = lambda node: [f"--node-rank={node}", "--master-addr=127.0.0.1",
                                   f"--master-port={port}"]
    else:  # c10d rendezvous: the agents agree on ranks themselves
        rendezvous = lambda node: ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                   "--rdzv-id=minddp-test"]
    return _two_agents(rendezvous, tmp / "two.txt")


AGENTS = {how: ahead(_agents, how) for how in ("static", "c10d")}


@pytest.mark.parametrize("how", ["static", "c10d"])
def test_two_agents_equal_one_agent(one_agent_table, how):
    for code, out, err in AGENTS[how].result():
        assert code == 0, err[-3000:]
    verdict = diff(AGENTS[how].tmp / "two.txt", one_agent_table)
    assert verdict.returncode == 0 and "IDENTICAL" in verdict.stdout, verdict.stdout


def test_a_port_taken_before_node_0_binds_it_ends_that_try_at_once_and_another_is_made(
        tmp_path, one_agent_table):
    # free_port() lets the port go before node 0's store binds it: here another socket holds
    # it. Node 0 fails (EADDRINUSE) and node 1, connected to a listener that is no store,
    # would wait 15 min: the try ends with node 0, and the next port is taken.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tries = []
        ports = (tries.append(port) or port for port in (taken.getsockname()[1], free_port()))
        outputs = _agents(tmp_path, "static", ports)
    assert len(tries) == 2, "a single try: the taken port was not met"
    for code, out, err in outputs:
        assert code == 0, err[-3000:]
    verdict = diff(tmp_path / "two.txt", one_agent_table)
    assert verdict.returncode == 0 and "IDENTICAL" in verdict.stdout, verdict.stdout


def _stuck(tmp):
    t0 = time.monotonic()
    return torchrun(2, STUCK, "--timeout", "3"), time.monotonic() - t0


STUCK_RUN = ahead(_stuck)


def test_stuck_peer_fails_within_the_timeout():
    # Rank 1 is alive but never joins the all_reduce (a diverged rank): rank 0 must give
    # up after the 3 s process-group timeout with one clear line, not after 30 minutes.
    result, elapsed = STUCK_RUN.result()
    assert result.returncode != 0
    assert "[rank0] error: a collective did not complete: Timed out" in result.stderr, result.stderr
    assert "Timed out waiting 3000ms" in result.stderr  # the timeout in force, in gloo's words
    assert "process-group timeout (--timeout S" in result.stderr
    # No assertion on the time it took (a busy machine stretches it): gloo's message names
    # the 3 s timeout in force. The ranks wait for each other to start before that clock
    # runs (launch/start.py), so a slow start on a busy machine is not taken for a stuck peer.
    print(f"stuck peer: failed after {elapsed:.1f} s (timeout 3 s, startup included)")


OUT_OF_RANGE = ahead_run([sys.executable, str(RESTART), "--checkpoint", "unused.pt",
                          "--crash-at-step", "9"])


def test_crash_step_out_of_range_is_refused():
    result = OUT_OF_RANGE.result()
    assert result.returncode == 2
    assert "error: --crash-at-step 9 is never reached: this run takes 6 optimizer steps" in result.stderr


def test_two_plain_python_runs_at_once_need_no_port():
    cmd = [sys.executable, str(MANUAL), "--epochs", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT="1")  # a port nobody could use
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err
        assert "Test accuracy" in out


def _mismatched_models(rank, world_size):
    hidden = 30 if rank == 0 else 31  # e.g. a width computed from something rank-dependent
    model = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    try:
        ManualDDP(model)
    except UsageError as err:
        return str(err)


share_spawn(_mismatched_models, [2])  # in the suite's shared 2-rank spawn


def test_models_that_differ_are_named_on_every_rank():
    messages = shared_results(_mismatched_models, 2)
    assert messages[0] == messages[1]  # every rank reaches the same verdict: nobody waits
    assert messages[0].startswith("rank 1's model differs from rank 0's at parameter #0:"
                                  " rank 0 has '0.weight' [30, 2] torch.float32,"
                                  " rank 1 has '0.weight' [31, 2] torch.float32")


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare_head = (torch.nn.Linear(2, 2) for _ in range(3))

    def forward(self, x):
        return self.head(self.body(x))  # spare_head is never used


def _unused_parameter(rank, world_size):
    messages = []
    for wrapper in (ManualDDP, NaiveDDP):
        model = wrapper(TwoHeads())
        try:
            model(torch.ones(1, 2)).sum().backward()
        except UsageError as err:
            messages.append(str(err))
    return messages


def test_a_parameter_without_gradient_is_named():
    for messages in run_ranks(_unused_parameter, 2):
        assert len(messages) == 2  # bucketed and naive, both raise instead of hanging
        for m in messages:
            assert m.startswith("parameter 'spare_head.weight' requires grad but got no gradient"
                                " in this backward (and 1 more)"), m
            assert "requires_grad_(False)" in m
