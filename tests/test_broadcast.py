"""broadcast_parameters: every rank ends with rank 0's parameters and buffers.

    pytest tests/test_broadcast.py
"""

import torch

from helpers import share_spawn, shared_results
from minddp import broadcast_parameters


def _model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model[1].running_mean.fill_(float(seed))  # a buffer that differs per rank too
    return model


def _broadcast(rank, world_size):
    states = []
    for src in (0, 2):
        model = _model(seed=100 + rank)  # every rank starts different
        weight = model[0].weight  # the optimizer would hold this very tensor
        broadcast_parameters(model, src=src)
        assert model[0].weight is weight  # in place
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def test_every_rank_gets_the_source_ranks_state():
    results = shared_results(_broadcast, 3)
    for i, src in enumerate((0, 2)):
        expected = _model(seed=100 + src).state_dict()
        for states in results:
            assert states[i].keys() == expected.keys()
            for key in expected:
                assert torch.equal(states[i][key], expected[key]), (src, key)
    assert not torch.equal(_model(101)[0].weight, _model(100)[0].weight)  # the ranks did differ


share_spawn(_broadcast, [3])  # in the spawn the other modules share
