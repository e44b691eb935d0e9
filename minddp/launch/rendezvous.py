"""Rendezvous: where torchrun's ranks meet before the process group exists.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # every example meets here
    pytest tests/test_faults.py -k restart               # a crashed attempt, restarted

dist.init_process_group(store=...) needs a key-value store that every rank can reach: the
ranks write their addresses there and read each other's. start.py's ddp_setup takes it
from here. Three things decide what the store is:
  alone        plain `python script.py`: a world of one meets nobody, an in-process store
  torchrun     the address torchrun exports (MASTER_ADDR, MASTER_PORT): the env:// store
  restarted    torchrun --max-restarts keeps one store for every attempt: each attempt
               gets its own prefix in it, or gloo would dial the dead attempt's peers
and one rule: every rank waits here until all have arrived, so the collectives' timeout
measures a peer that stopped taking part, never one still importing torch.
"""

import datetime
import os
import sys

import torch.distributed as dist

ARRIVAL_TIMEOUT = datetime.timedelta(minutes=10)  # the longest a rank waits for its peers to start


def meeting_store(rank, world_size):
    """The store the ranks meet in, once every rank has arrived there. Collective."""
    if "WORLD_SIZE" not in os.environ:
        return dist.HashStore()  # one process meets nobody: no port needed
    if sys.platform == "win32":
        os.environ["USE_LIBUV"] = "0"  # Windows builds ship the TCP store without libuv
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=ARRIVAL_TIMEOUT))
    # After a restart (torchrun --max-restarts) the workers meet in torchrun's store, which
    # holds the dead attempt's keys. A store started anew each round
    # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) needs no prefix, and must have none: a node
    # that joins later counts attempts from 0, the others not.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        store = dist.PrefixStore(f"minddp/attempt{attempt}", store)
    # The arrival barrier: a busy machine took 17 s to import torch (measured at load 14).
    if store.add("arrived", 1) == world_size:
        store.set("all arrived", "yes")
    store.wait(["all arrived"])
    return store
