"""The CUDA paths, where a GPU is present: nccl, CUDA tensors over gloo, the benchmark on a GPU.

    pytest tests/test_gpu.py          # on a machine with CUDA; skipped elsewhere, with the reason

The rest of the suite hides CUDA from the processes it starts (tests/helpers.py), so it
runs the same CPU/gloo tests on any machine; these tests are the ones that mean a GPU.
"""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import REPO, run, run_ranks, torchrun
from minddp import ManualDDP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA (torch.cuda.is_available() is False here)")
STOCK, MANUAL = REPO / "examples" / "stock_ddp.py", REPO / "examples" / "manual_ddp.py"
OUR_WARNINGS = ("Guessing device ID based on global rank", "using the device under current context")


def diff(a, b):
    return run([sys.executable, "-m", "minddp", "diff", str(a), str(b)])


@pytest.mark.parametrize("nproc,flags", [(1, ["--backend", "nccl"]),
                                         (2, ["--backend", "gloo", "--device", "cuda"])],
                         ids=["nccl-1-process", "gloo-2-processes-sharing-the-gpu"])
def test_examples_on_the_gpu_are_identical(tmp_path, nproc, flags):
    tables = {}
    for script in (STOCK, MANUAL):
        tables[script] = tmp_path / f"{script.stem}.txt"
        result = torchrun(nproc, script, *flags, "--grad-table", tables[script], gpu=True)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "on cuda:0" in result.stdout
        assert not any(w in result.stderr for w in OUR_WARNINGS), result.stderr[-3000:]
    verdict = diff(tables[MANUAL], tables[STOCK])
    assert verdict.returncode == 0 and "IDENTICAL" in verdict.stdout, verdict.stdout


def _buckets_on_cuda(rank, world_size):
    torch.manual_seed(rank)
    base = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 3)).cuda()
    stock = DDP(copy.deepcopy(base), device_ids=[0])
    manual = ManualDDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.5)
    equal = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 64, generator=g).cuda(), torch.randint(0, 3, (8,), generator=g).cuda()
        grads = []
        for model in (stock, manual):
            model.zero_grad()
            # Inputs on the CPU: with device_ids=[0] both wrappers move them to cuda:0.
            F.cross_entropy(model(x.cpu()), y).backward()
            grads.append([p.grad.clone() for p in model.module.parameters()])
        equal.append(all(torch.equal(a, b) for a, b in zip(*grads)))
    return equal


@pytest.mark.parametrize("world_size", [1, 2])
def test_buckets_with_cuda_tensors_bitwise_equal_to_stock(world_size):
    for equal in run_ranks(_buckets_on_cuda, world_size, gpu=True):
        assert equal == [True, True, True]


def test_benchmark_runs_on_the_gpu():
    result = run([sys.executable, "-m", "minddp", "bench", "--device", "cuda", "--backend", "nccl",
                  "--world-sizes", "1", "--sizes", "0.3M", "--rounds", "3", "--warmup", "1"], gpu=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nccl on cuda" in result.stdout and "stock fp16" in result.stdout
