"""Minimal reproduction: a gloo rank that never exits when DDP outlives destroy_process_group().

    for i in $(seq 40); do timeout 30 torchrun --standalone --nproc_per_node=2 \\
        tests/scripts/teardown_deadlock.py >/dev/null 2>&1 || echo "run $i: exit $?"; done

Plain torch, no minddp (seen with torch 2.13.0+cpu on a 2-core Linux VM: some runs end
with exit 124, the timeout's). What happens in a hung rank (gdb, thread apply all bt):
main() returns and its frame frees `model`; stock DDP's C++ reducer drops the last
reference to the process group, so ~ProcessGroupGloo runs on the main thread with the
GIL held and joins its worker threads; one of them is still destroying the barrier's
work, which holds gather_object's work and its Python-visible tensors, and waits for
the GIL. Freeing the model *before* destroy_process_group() (minddp.ddp_teardown's
order) lets destroy_process_group() drop the last reference from Python, which releases
the GIL while it joins.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object([torch.ones(3)], out, dst=0)  # a collective with Python tensors
    dist.barrier()
    dist.destroy_process_group()  # the lesson's place: at the end of main(), model alive


if __name__ == "__main__":
    main()
