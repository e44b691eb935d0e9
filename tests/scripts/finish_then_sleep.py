"""A worker that finishes, then never exits: what a teardown hang looks like from outside.

    torchrun --nproc_per_node=2 tests/scripts/finish_then_sleep.py

tests/test_exit.py checks that the test helpers kill such workers (each lives in a
session of its own under torchrun) and do not block reading their output.
"""

import time

from minddp import ddp_setup, ddp_teardown, print_rank

if __name__ == "__main__":
    ddp_setup("gloo", "cpu")
    ddp_teardown()
    print_rank("finished")
    time.sleep(3600)
