"""Launching: torchrun's processes become ranks of one group, and leave it cleanly.

    torchrun --nproc_per_node=2 examples/manual_ddp.py   # 2 processes on this machine
    python examples/manual_ddp.py                        # 1 process, world size 1
    pytest tests/test_launch.py tests/test_groups.py tests/test_exit.py

Lesson 9.3 starts every rank with torchrun; this chapter is what happens next. Each rank
reads who it is from the environment, picks a backend and a device (gloo on a CPU, nccl on a
GPU, mps on Apple silicon), meets the others at the rendezvous, and at the end leaves in an
order that lets every rank exit. Every later chapter starts here, and raises the one error
type defined here. Read in this order:
    usage_error.py  UsageError: a mistake in one line and a hint, exit 2
    backends.py     which backend and device a rank uses
    start.py        torchrun's environment -> rank, local_rank, world_size; ddp_setup
    rendezvous.py   where the ranks meet before the group exists
    groups.py       process groups of some of the ranks; a rank's two numbers
    teardown.py     ddp_teardown: a finished run exits, every rank, always
The examples: examples/devices.py (9.1), examples/single_device.py (9.2), and the two DDP
examples (9.3). The docs page of what goes wrong at the edges: docs/failures.md.
"""
