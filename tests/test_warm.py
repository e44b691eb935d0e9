"""Warm ranks (minddp/run/warm.py): forked from a server that imported torch once.

    pytest tests/test_warm.py

The ranks of tests/helpers.py's run_ranks (and so of every shared spawn) and of the grader
start from multiprocessing's fork server, which preloads torch and minddp: the rank's parent
is the server, not the test, and torch was imported before the rank began. What must not
change with it: each rank sees the environment of the test that started it (not the
server's, which started earlier), draws its own Python random numbers, and makes and tears
down its own process group (run_ranks checks that no gloo thread outlives it).
"""

import os
import random
import sys

import torch.distributed as dist

from helpers import run_ranks
from minddp.run.warm import PRELOAD


def _facts(rank, world_size):
    return {"parent": os.getppid(), "said": os.environ.get("MINDDP_WARM_TEST"),
            "preloaded": [m for m in PRELOAD if m in sys.modules],
            "random": random.random(), "group": dist.get_world_size()}


def test_a_warm_rank_is_forked_from_the_server_and_sees_the_tests_environment(monkeypatch):
    run_ranks(_facts, 1)  # the server is running from here on
    monkeypatch.setenv("MINDDP_WARM_TEST", "set after the server started")
    facts = run_ranks(_facts, 2)
    for rank, seen in enumerate(facts):
        assert seen["parent"] != os.getpid(), rank  # forked by the server
        assert seen["preloaded"] == PRELOAD, rank
        assert seen["said"] == "set after the server started", rank
        assert seen["group"] == 2
    assert facts[0]["random"] != facts[1]["random"]  # random reseeded after the fork
