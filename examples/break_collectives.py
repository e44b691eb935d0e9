"""Break the collectives and see: chapter 0's ring with one piece wrong, beside gloo's.

    torchrun --nproc_per_node=2 examples/break_collectives.py --break all --timeout 10
    torchrun --nproc_per_node=3 examples/break_collectives.py --break off-by-one
    torchrun --nproc_per_node=2 examples/break_collectives.py --break lost-send --timeout 5

Each break patches one function of minddp/collectives/ for this run (the library itself
stays unbroken), then every rank runs the collective on random float32 values beside gloo's
own and rank 0 says how far the result lands. The last break leaves a send without its
receive: gloo's send waits for the receive, so the sender hangs, and says where once
--timeout runs out (exit status 1). docs/collectives.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "off-by-one": "a ring step off by one: reduce_scatter sends block rank + step, not"
                  " rank + step + 1",
    "stay-home": "reduce_scatter's blocks never travel: each rank keeps its own",
    "lost-send": "rank 0 sends one block more than its neighbour ever receives",
}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="all", choices=[*BREAKS, "all"])
    parser.add_argument("--timeout", type=float, default=30, metavar="S",
                        help="seconds a rank waits in a send or receive before failing")
    args = parser.parse_args()

import torch
import torch.distributed as dist

import minddp.collectives.p2p as p2p
import minddp.collectives.ring_all_gather as gather
import minddp.collectives.ring_all_reduce as ring
import minddp.collectives.ring_reduce_scatter as scatter
from minddp import ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0
from minddp.collectives import all_reduce, reduce_scatter_tensor
from minddp.run.errors import CollectiveFailure

UNBROKEN = {"ring_reduce_scatter": scatter.ring_reduce_scatter, "exchange": p2p.exchange}


def off_by_one(blocks, op, group):
    """The ring's reduce_scatter, with the block sent one behind the block received."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(blocks[0])  # (equal blocks: run() picks the size)
    for step in range(size - 1):
        mine = blocks[(rank + step + 2) % size]
        p2p.exchange(group, sends=[(blocks[(rank + step) % size], (rank - 1) % size)],
                     receives=[(incoming, (rank + 1) % size)])  # the break: rank + step
        mine.add_(incoming)


def stay_home(blocks, op, group):
    """The ring's reduce_scatter without its steps: every block stays where it started."""


LOST = []  # the lost send, once posted


def lost_send(group, sends=(), receives=()):
    """exchange(); and on rank 0, once, one send more, to rank 1, which never receives it."""
    named(lambda: UNBROKEN["exchange"](group, sends, receives), sends, receives)
    if dist.get_rank(group) == 0 and not LOST:
        # A tag no receive of rank 1 asks for: nothing ever matches this send, and a gloo
        # send waits until its receive is posted.
        LOST.append(dist.isend(torch.ones(4), dst=1, group=group, tag=p2p.TAG + 1))
        named(LOST[0].wait, [(None, 1)], [])


def named(wait, sends, receives):
    """wait(), turning gloo's timeout into a line that names this rank and its peers."""
    try:
        wait()
    except RuntimeError as error:
        words = str(error).splitlines()[0].split("] ")[-1]
        if "send operation" in words or not receives:  # a lone send: its peer left
            where = "send to rank " + ", ".join(sorted({str(peer) for _, peer in sends}))
        else:
            where = "receive from rank " + ", ".join(sorted({str(p) for _, p in receives}))
        raise CollectiveFailure(f"rank {dist.get_rank()} stuck in {where} after"
                                f" {args.timeout:g} s: {words}",
                                hint="every send needs its receive, posted by the peer in"
                                     " the same step") from None


def patch(broken):
    scatter.ring_reduce_scatter = UNBROKEN["ring_reduce_scatter"]
    ring.ring_reduce_scatter = UNBROKEN["ring_reduce_scatter"]
    for module in (p2p, scatter, gather):
        module.exchange = UNBROKEN["exchange"]
    if broken == "off-by-one":
        ring.ring_reduce_scatter = off_by_one  # all_reduce's first half
    elif broken == "stay-home":
        scatter.ring_reduce_scatter = stay_home
    elif broken == "lost-send":
        for module in (p2p, scatter, gather):
            module.exchange = lost_send


def run(env, broken):
    patch(broken)
    n = 8 * env.world_size  # W equal blocks, for gloo's ring too (all_reduce.gloo_blocks)
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-20, 21, (n,), generator=g)
    if broken == "stay-home":
        theirs, ours = torch.empty(4), torch.empty(4)
        dist.reduce_scatter_single(theirs, x[:4 * env.world_size])
        reduce_scatter_tensor(ours, x[:4 * env.world_size])  # every rank keeps 4
        own = torch.equal(ours, x[4 * env.rank:4 * env.rank + 4])
        differ = int((ours != theirs).sum())
        print0(f"--break {broken}: rank 0's piece is its own input{'' if own else ' (no?)'},"
               f" not the sum over {env.world_size} ranks ({differ} of 4 elements differ"
               f" from gloo's)")
        return
    theirs, ours = x.clone(), x.clone()
    dist.all_reduce(theirs)
    all_reduce(ours)  # lost-send: rank 0 hangs in its first step, rank 1 one step later
    differ = int((ours != theirs).sum())
    if differ == 0:
        print0(f"--break {broken}: every rank equal to gloo's all_reduce, bit for bit")
    else:
        gap = (ours - theirs).abs().max().item()
        print0(f"--break {broken}: {differ} of {x.numel()} elements differ from gloo's"
               f" (rank 0), by up to {gap:.3g}")


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        env = ddp_setup("gloo", "cpu", args.timeout)
        for broken in BREAKS if args.broken == "all" else [args.broken]:
            print0(f"--break {broken}: {BREAKS[broken]}")
            run(env, broken)
        patch("none")
        ddp_teardown()
