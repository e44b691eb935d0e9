"""A rank that stops taking part: rank 1 sleeps while rank 0 waits for it in an all_reduce.

    torchrun --nproc_per_node=2 tests/scripts/stuck_peer.py --timeout 3

Rank 0 should fail after about --timeout seconds with one line and a hint (errors.py).
"""

import argparse
import time

import torch
import torch.distributed as dist

from minddp import ddp_setup, exit_on_failure, exit_on_usage_error


def main(args):
    env = ddp_setup("gloo", "cpu", timeout=args.timeout)
    if env.rank == 1:
        time.sleep(60)  # alive, but diverged: it never reaches the collective below
    dist.all_reduce(torch.ones(1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=3)
    with exit_on_failure(), exit_on_usage_error():
        main(parser.parse_args())
