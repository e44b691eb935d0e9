"""Uneven inputs: one rank has a batch more than the others. Without join() it waits forever.

    torchrun --nproc_per_node=2 examples/uneven.py --timeout 5           # the hang, bounded
    torchrun --nproc_per_node=2 examples/uneven.py --join                # model.join(): done
    torchrun --nproc_per_node=2 examples/uneven.py --join --ddp stock    # stock's join()

Each rank gets its own number of batches (rank r: 3 + r), as per-rank files or a filter
that drops bad examples would give. The rank with more batches all-reduces buckets nobody
answers. Inside `with model.join():` a rank that ran out answers with zeros until all are
done (minddp/dropin/join.py), and every rank ends with the same weights.
"""

from minddp.run.cli import lesson_parser, parse_checked


def parse():
    parser = lesson_parser(__doc__)
    parser.add_argument("--join", action="store_true", help="train inside model.join()")
    parser.add_argument("--ddp", default="manual", choices=["manual", "stock"],
                        help="minddp's ManualDDP or stock PyTorch's DDP")
    return parse_checked(parser)


if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    args = parse()

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minddp import (ManualDDP, NeuralNetwork, check_replicas, ddp_setup, ddp_teardown,
                    exit_on_failure, exit_on_usage_error, print0)
from minddp.run.errors import CollectiveFailure, is_collective_failure
from torch.nn.parallel import DistributedDataParallel as DDP


def main(env, args):
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(env.rank)  # each rank its own data, its own amount
    batches = [(torch.randn(2, 2, generator=g), torch.randint(0, 2, (2,), generator=g))
               for _ in range(3 + env.rank)]
    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model = (ManualDDP if args.ddp == "manual" else DDP)(model, device_ids=env.device_ids)
    steps = 0
    try:
        with model.join() if args.join else contextlib.nullcontext():
            for features, labels in batches:
                optimizer.zero_grad()
                F.cross_entropy(model(features), labels).backward()  # all-reduces the buckets
                optimizer.step()
                steps += 1
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, steps)  # collective: what each rank did
    except RuntimeError as err:
        # Whichever rank's timeout runs out first exits: the other then hears "Connection
        # closed by peer" instead of its own timeout. The cause is the same.
        if not is_collective_failure(err):
            raise
        why = "timed out" if "imed out" in str(err) else "a peer gave up"
        raise CollectiveFailure(f"{why} after this rank's {steps} steps ({len(batches)}"
                                f" batches here): the ranks took different numbers of steps",
                                hint="give every rank the same number of batches (ShardSampler"
                                     " does), or train inside `with model.join():` (--join)")
    print0("steps per rank: " + ", ".join(f"rank {r}: {s}" for r, s in enumerate(everyone)))
    check_replicas(model)  # collective: the same weights everywhere, bit for bit
    print0("replicas identical after join()")


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env}")  # world size, backend and device
        main(env, args)
        ddp_teardown()  # after main() has returned and freed the model: teardown.py says why
