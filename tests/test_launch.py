"""Backend and device choice on fake machines, and how a usage error reaches the user.

    pytest tests/test_launch.py
"""

import pytest

from minddp import UsageError, exit_on_usage_error
from minddp.launch.backends import choose_backend


def pick(backend="auto", device="auto", local_rank=0, local_world_size=1, world_size=None,
         cuda=0, mps=False, windows=False):
    return choose_backend(backend, device, local_rank, local_world_size,
                          world_size or local_world_size, cuda, mps, windows)


def test_laptop_cpu_gets_gloo_on_cpu():
    assert pick(local_rank=1, local_world_size=2) == ("gloo", "cpu")


def test_gpu_box_gets_nccl_with_one_gpu_per_local_rank():
    assert pick(local_rank=3, local_world_size=4, world_size=8, cuda=4) == ("nccl", "cuda:3")


def test_too_few_gpus_for_auto_falls_back_to_gloo_on_cpu():
    assert pick(local_rank=1, local_world_size=2, cuda=1) == ("gloo", "cpu")


def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(UsageError, match="nccl needs CUDA") as info:
        pick("nccl", local_world_size=2)
    assert "gloo" in info.value.hint


def test_more_ranks_than_gpus_with_nccl_is_a_clear_error():
    # The lesson's script dies here with "CUDA error: invalid device ordinal".
    with pytest.raises(UsageError, match="more ranks than GPUs: local rank 2 needs cuda:2") as info:
        pick("nccl", local_rank=2, local_world_size=3, cuda=2)
    assert "--nproc_per_node=2" in info.value.hint
    assert pick("nccl", local_rank=1, local_world_size=3, cuda=2) == ("nccl", "cuda:1")


def test_gloo_can_share_one_gpu():
    assert pick("gloo", "cuda", local_rank=1, local_world_size=2, cuda=1) == ("gloo", "cuda:0")


def test_apple_silicon_runs_one_process_on_mps():
    assert pick(mps=True) == ("gloo", "mps")
    assert pick(local_world_size=2, mps=True) == ("gloo", "cpu")  # several processes: CPU
    with pytest.raises(UsageError, match="mps runs a single process"):
        pick(device="mps", local_world_size=2, mps=True)


def test_windows_uses_gloo_even_with_gpus():
    assert pick(local_world_size=2, local_rank=1, cuda=2, windows=True) == ("gloo", "cuda:1")
    with pytest.raises(UsageError, match="Windows"):
        pick("nccl", cuda=1, windows=True)


def test_usage_error_prints_one_line_and_a_hint_then_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        with exit_on_usage_error():
            raise UsageError("something is off", hint="do this instead")
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: something is off", "---> HINT: do this instead"]


def test_same_on_every_rank_errors_print_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        with exit_on_usage_error():
            raise UsageError("data too small", hint="h", same_on_every_rank=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("installed,refused", [("2.10.0", True), ("2.6.0+cu124", True),
                                                ("2.11.0+cu130", False), ("2.12.1", False),
                                                ("2.13.0+cpu", False), ("2.15.0", False),
                                                ("3.0.0", False)])
def test_a_torch_older_than_the_floor_is_refused_in_one_line(monkeypatch, installed, refused):
    import importlib.metadata
    from minddp.run import cli
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    said = cli.torch_too_old()
    assert (said is not None) == refused
    if refused:
        lines = said.splitlines()
        assert lines[0] == f"error: minddp needs torch 2.11 or later, found {installed}"
        assert len(lines) == 2 and lines[1].startswith("---> HINT: pip install 'torch>=2.11'")
