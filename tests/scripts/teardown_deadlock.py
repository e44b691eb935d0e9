"""Minimal reproduction: a gloo rank that never exits when DDP outlives destroy_process_group().

    timeout 120 torchrun --standalone --nproc_per_node=2 tests/scripts/teardown_deadlock.py; echo $?
    timeout 120 torchrun --standalone --nproc_per_node=2 tests/scripts/teardown_deadlock.py 300 fixed

Plain torch, no minddp. Each round starts a process group, wraps a model in stock DDP,
runs a gather_object (a collective whose work holds Python-visible tensors), a barrier,
destroy_process_group(), and then returns, which frees the model. If it prints "all
rounds done" and exits 0, no round hung; exit 124 (the timeout's) means a rank hung.
With `fixed`, each round frees the model before destroy_process_group().

What happens in a hung rank (gdb, thread apply all bt; torch 2.13.0+cpu): the return frees
`model`; stock DDP's C++ reducer drops the last reference to the process group, so
~ProcessGroupGloo runs on the main thread with the GIL held and joins its worker threads;
one of them is still destroying the barrier's work, which holds gather_object's work and
its tensors, and waits for the GIL. Freeing the model *before* destroy_process_group()
(minddp.ddp_teardown's order) lets destroy_process_group() drop the last reference from
Python, which releases the GIL while it joins.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def one_round(store, i, rank, world_size, fixed):
    dist.init_process_group("gloo", store=dist.PrefixStore(f"round{i}", store), rank=rank,
                            world_size=world_size)
    model = DDP(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    out = [None] * world_size if rank == 0 else None
    dist.gather_object([torch.ones(3)], out, dst=0)
    dist.barrier()
    if fixed:
        del model  # minddp's order: the model goes first, the group stays registered
    dist.destroy_process_group()  # the lesson's place: the model is still alive here
    # returning frees `model`, and with it the group's last reference


if __name__ == "__main__":
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                          world_size, is_master=rank == 0)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    fixed = sys.argv[2:] == ["fixed"]
    for i in range(rounds):
        one_round(store, i, rank, world_size, fixed)
        if i % 50 == 49:
            print(f"[rank{rank}] {i + 1} rounds", flush=True)
    print(f"[rank{rank}] all {rounds} rounds done", flush=True)
