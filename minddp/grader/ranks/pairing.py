"""Do a student's sends and receives pair up? Found in a dry run, before the real one hangs.

    minddp grade exercises/ring.py       # checks/ring.py asks this first, for every size

gloo pairs a receive with the next message the named rank sends it (any size up to the
receive's). So a receive that no send matches does not fail: it waits, or takes a later
message (the next step's, the next collective's), and the ranks hang further on, somewhere
that names nothing of the cause. Here the student's function runs once with its
point-to-point calls recorded, not sent (each returns at once, as if done), every rank's
record is gathered, and each link's sends are read against its receives, in order.
"""

import contextlib

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..shared.training import _everyone

CALLS = ("send", "recv", "isend", "irecv")


class _Done:
    """What a recorded isend/irecv returns: a request already complete."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


@contextlib.contextmanager
def _recorded(log):
    """dist's point-to-point calls append (kind, peer, elements) to `log`, and move nothing."""
    # torch.distributed's names and c10d's module globals, which P2POp checks its op against
    modules = (dist, c10d)
    saved = {(m, name): getattr(m, name)
             for m in modules for name in (*CALLS, "batch_isend_irecv")}

    def call(kind):
        def record(tensor, peer=None, group=None, tag=0, **kwargs):
            log.append((kind.lstrip("i"), peer if peer is not None else
                        kwargs.get("dst", kwargs.get("src")), tensor.numel()))
            return _Done() if kind.startswith("i") else (peer if kind == "recv" else None)
        record.__name__ = kind  # a P2POp made with it is read by this name, as stock's
        return record
    for name in CALLS:
        recorder = call(name)
        for m in modules:
            setattr(m, name, recorder)
    # P2POp keeps the function it was given (dist.isend, or ours): read by its name
    dist.batch_isend_irecv = c10d.batch_isend_irecv = lambda ops: [
        log.append((op.op.__name__.lstrip("i"), op.peer, op.tensor.numel())) or _Done()
        for op in ops]
    try:
        yield
    finally:
        for (m, name), original in saved.items():
            setattr(m, name, original)


def unpaired(run, what):
    """None if every rank's sends meet the receives posted for them, else (where, why).
    `run()` calls the student's function on this rank; `what` names it. Collective."""
    log = []
    with _recorded(log):
        run()
    everyone = _everyone(log)
    for src, sent_log in enumerate(everyone):
        for dst, got_log in enumerate(everyone):
            sent = [n for kind, peer, n in sent_log if kind == "send" and peer == dst]
            got = [n for kind, peer, n in got_log if kind == "recv" and peer == src]
            # a receive may be larger than its message (gloo fills the front), never smaller
            i = next((i for i, (a, b) in enumerate(zip(sent, got)) if b < a), None)
            if i is None and len(sent) == len(got):
                continue
            i = min(len(sent), len(got)) if i is None else i
            where = (f"{what}, rank {src} -> rank {dst}: message {i}: rank {src} sends"
                     f" {_count(sent, i)}, rank {dst} posts a receive of {_count(got, i)}")
            return where, (
                ("a receive smaller than the message it meets: gloo aborts the rank (SIGABRT)"
                 if i < min(len(sent), len(got)) else
                 "a receive and a send that do not pair up: gloo gives a receive the next"
                 " message from that rank, so a receive no send matches waits forever or takes"
                 " a later one (the next step's, the next collective's), and the ranks hang"
                 " further on") + "; post a receive for exactly the block that comes, and none"
                " for an empty block (exchange() posts neither side of one)")
    return None


def _count(sizes, i):
    return f"{sizes[i]} element{'s' * (sizes[i] != 1)}" if i < len(sizes) else "nothing"
