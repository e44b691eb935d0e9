"""join(): uneven inputs, ManualDDP against stock DDP's join(), bit for bit.

    pytest tests/test_join.py

Rank r trains on 3 + r * extra batches inside model.join() (or the reverse: rank 0 the
longest), so the ranks run out one after the other and the joined ones shadow the rest. Compared on every rank after the context
manager: every parameter and buffer (BatchNorm's running statistics), stock DDP vs
ManualDDP with the same arguments, momentum SGD, several buckets.
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ahead import ahead_torchrun
from helpers import REPO, share_spawn, shared_results, warm_torchrun
from minddp import ManualDDP, UsageError


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _train(wrapper, base, rank, extra, divide, throw=False):
    model = wrapper(copy.deepcopy(base), bucket_cap_mb=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    world_size = torch.distributed.get_world_size()
    # extra 1: the higher ranks train longer; extra 2: rank 0 does, so a joined rank is
    # the highest one and must not be the one the others take their buffers from.
    steps = 3 + (rank if extra == 1 else world_size - 1 - rank) * extra
    with model.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw):
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _join_cases(rank, world_size):
    torch.manual_seed(rank)  # different first weights: both wrappers broadcast rank 0's
    base = _model()
    problems, states = [], {}
    for extra in (1, 2):
        for divide in (True, False):
            stock = _train(DDP, base, rank, extra, divide)
            manual = _train(ManualDDP, base, rank, extra, divide)
            states[extra, divide] = manual
            bad = [k for k in stock if not torch.equal(stock[k], manual[k])]
            if bad:
                problems.append(f"extra {extra}, divide {divide}: {bad}")
    raised = {}
    for wrapper in (DDP, ManualDDP):
        try:
            _train(wrapper, base, rank, 1, True, throw=True)
        except RuntimeError as err:
            raised[wrapper.__name__] = str(err)
    return problems, states, raised


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_is_bitwise_stocks(world_size):
    results = shared_results(_join_cases, world_size)
    for problems, _, raised in results:
        assert problems == []
        # throw_on_early_termination: every rank raises, the same way in both wrappers
        assert raised.keys() == {"DistributedDataParallel", "ManualDDP"}
        assert raised["ManualDDP"] == raised["DistributedDataParallel"]
    for key, state in results[0][1].items():  # and the replicas agree at the end
        for _, states, _ in results[1:]:
            assert all(torch.equal(state[k], states[key][k]) for k in state), key


def _refused(rank, world_size):
    model = ManualDDP(torch.nn.Linear(2, 2), find_unused_parameters=True)
    try:
        model.join()
    except UsageError as err:
        return str(err)


def test_join_with_find_unused_parameters_is_one_clear_error():
    message = shared_results(_refused, 1)[0]
    assert message.startswith("ManualDDP.join() with find_unused_parameters=True is not implemented")


UNEVEN = ahead_torchrun(2, REPO / "examples" / "uneven.py", "--timeout", "5")


def test_the_uneven_example_without_join_ends_with_the_cause_and_with_join_trains():
    # Rank r has 3 + r batches. Without join(): no 30-minute hang, but a line within the
    # --timeout, naming the cause and the fix.
    hung = UNEVEN.result()
    assert hung.returncode != 0
    # Both ranks time out at about the same moment. The rank whose timeout runs out second
    # may hear its peer leave first ("a peer gave up"), or, on a busy machine, be stopped by
    # torchrun (SIGTERM) before it speaks: torchrun ends the other worker as soon as one has
    # failed. So each rank that speaks names the cause and the fix, and at least one does.
    spoke = 0
    for rank, steps, batches in ((0, 3, 3), (1, 3, 4)):
        said = (rf"\[rank{rank}\] error: a collective did not complete: (timed out|a peer gave"
                rf" up) after this rank's {steps} steps \({batches} batches here\): the ranks"
                rf" took different numbers of steps")
        if f"[rank{rank}] error:" in hung.stderr:
            assert re.search(said, hung.stderr), hung.stderr[-2000:]
            spoke += 1
    assert spoke >= 1, hung.stderr[-2000:]
    assert hung.stderr.count("or train inside `with model.join():` (--join)") == spoke
    assert set(re.findall(r"exitcode\s*: (-?\d+)", hung.stderr)) <= {"1", "-15"}, \
        hung.stderr[-2000:]
    joined = warm_torchrun(2, REPO / "examples" / "uneven.py", "--join")
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert "steps per rank: rank 0: 3, rank 1: 4" in joined.stdout
    assert "replicas identical after join()" in joined.stdout


share_spawn(_join_cases, [2, 3])  # one spawn per world size, shared
share_spawn(_refused, [1])
