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


def _collector(rank, world_size):
    import gc
    import weakref

    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from minddp.launch.teardown import forget_dtensor_caches

    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made in the rank: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    # a DTensor redistribution fills a cache made at import, before the server's freeze
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    filled = _gen_transform_infos.cache_info().currsize
    del x, mesh
    forget_dtensor_caches()
    return {"frozen": gc.get_freeze_count(), "cycle freed": gone() is None, "filled": filled,
            "after forget": _gen_transform_infos.cache_info().currsize}


def test_a_warm_rank_collects_its_own_cycles_and_empties_dtensors_frozen_caches():
    # The server sets its imports aside from the collector (run/frozen.py): gc.collect() in a
    # rank reads only what the rank made. Its cycles are still freed, and DTensor's caches,
    # made at import and so frozen (gc.get_objects() no longer lists them), still emptied by
    # ddp_teardown (which run_ranks calls: no gloo thread may outlive it).
    for rank, seen in enumerate(run_ranks(_collector, 2)):
        assert seen["frozen"] > 100_000, (rank, seen)  # torch's import: ~300k objects
        assert seen["cycle freed"] and seen["filled"] > 0 and seen["after forget"] == 0, \
            (rank, seen)
