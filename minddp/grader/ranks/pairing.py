"""Do a student's sends and receives pair up? Found in a dry run, before the real one hangs.

    minddp grade exercises/ring.py       # checks/ring.py asks this first, for every size

gloo pairs a receive with the next message the named rank sends it (any size up to the
receive's). So a receive that no send matches does not fail: it waits, or takes a later
message (the next step's, the next collective's), and the ranks hang further on, somewhere
that names nothing of the cause. Here the student's function runs once with its
point-to-point calls recorded, not sent (each returns at once, as if done), every rank's
record is gathered, and each link's sends are read against its receives, in order. Then the
record is played out as gloo runs it: a send completes only once its peer has posted the
matching receive, a receive once the matching send is posted (examples/break_collectives.py
--break lost-send: a send nobody receives times out), isend and irecv post and go on, their
wait() blocks; so ranks that each wait in a blocking send for a receive their peer posts only
after its own send (a deadlock) are named too, before a real run hangs.
"""

import contextlib

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..shared.training import _everyone

CALLS = ("send", "recv", "isend", "irecv")


class _Posted:
    """What a recorded isend/irecv returns: its wait() is noted, and returns at once."""

    def __init__(self, log, post):
        self.log, self.post = log, post

    def wait(self, *args, **kwargs):
        self.log.append(("wait", self.post))
        return True

    def is_completed(self):
        return True


@contextlib.contextmanager
def _recorded(log):
    """dist's point-to-point calls append ("post", kind, peer, elements, tag) to `log`, and
    ("wait", the post's number) where the rank waits for it; nothing moves."""
    # torch.distributed's names and c10d's module globals, which P2POp checks its op against
    modules = (dist, c10d)
    saved = {(m, name): getattr(m, name)
             for m in modules for name in (*CALLS, "batch_isend_irecv")}
    posts = [0]

    def post(kind, peer, tensor, tag):
        log.append(("post", kind.lstrip("i"), peer, tensor.numel(), tag))
        posts[0] += 1
        return _Posted(log, posts[0] - 1)

    def call(kind):
        def record(tensor, peer=None, group=None, tag=0, **kwargs):
            peer = peer if peer is not None else kwargs.get("dst", kwargs.get("src"))
            posted = post(kind, peer, tensor, tag)
            if not kind.startswith("i"):  # a blocking call: posted, then waited for
                posted.wait()
                return peer if kind == "recv" else None
            return posted
        record.__name__ = kind  # a P2POp made with it is read by this name, as stock's
        return record
    for name in CALLS:
        recorder = call(name)
        for m in modules:
            setattr(m, name, recorder)
    # P2POp keeps the function it was given (dist.isend, or ours): read by its name
    dist.batch_isend_irecv = c10d.batch_isend_irecv = lambda ops: [
        post(op.op.__name__, op.peer, op.tensor, op.tag) for op in ops]
    try:
        yield
    finally:
        for (m, name), original in saved.items():
            setattr(m, name, original)


def unpaired(run, what):
    """None if every rank's sends meet the receives posted for them, and the ranks' waits
    can all complete, else (where, why). `run()` calls the student's function on this rank;
    `what` names it. Collective."""
    log = []
    with _recorded(log):
        run()
    everyone = _everyone(log)
    posted = [[e[1:4] for e in rank_log if e[0] == "post"] for rank_log in everyone]
    for src, sent_log in enumerate(posted):
        for dst, got_log in enumerate(posted):
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
    return _deadlock(everyone, what)


def _deadlock(everyone, what):
    """None if every rank's record runs to its end when each wait completes only once the
    other side of its message is posted; else (where, why): where each rank is stuck."""
    at, posts, counts = [0] * len(everyone), [[] for _ in everyone], {}

    def met(rank, post):  # the other side of this message is posted
        kind, peer, tag, k = post
        other = "recv" if kind == "send" else "send"
        return peer is None or counts.get((peer, other, rank, tag), 0) > k
    moved = True
    while moved:
        moved = False
        for rank, record in enumerate(everyone):
            while at[rank] < len(record):
                event = record[at[rank]]
                if event[0] == "post":
                    _, kind, peer, _, tag = event
                    key = (rank, kind, peer, tag)
                    posts[rank].append((kind, peer, tag, counts.get(key, 0)))
                    counts[key] = counts.get(key, 0) + 1
                elif not met(rank, posts[rank][event[1]]):
                    break
                at[rank] += 1
                moved = True
    stuck = [r for r, record in enumerate(everyone) if at[r] < len(record)]
    if not stuck:
        return None
    waits = {r: posts[r][everyone[r][at[r]][1]] for r in stuck}
    where = f"{what}: " + "; ".join(
        f"rank {r} waits in its {kind} {'to' if kind == 'send' else 'from'} rank {peer}"
        f" (message {k} of that link)" for r, (kind, peer, _, k) in waits.items())
    sends = all(kind == "send" for kind, _, _, _ in waits.values())
    return where, (
        ("a deadlock: every rank waits in a blocking send for a receive its peer posts only"
         " after its own send returns" if sends else
         "a deadlock: each of these ranks waits for a message its peer posts only after its"
         " own wait returns") + ". gloo's send completes only once the peer has posted the"
        " matching receive, so a step where every rank first sends, then receives, with"
        " blocking calls (send, recv), never gets going: post a step's sends and receives at"
        " once (p2p.exchange, or isend and irecv, then wait for both)")


def _count(sizes, i):
    return f"{sizes[i]} element{'s' * (sizes[i] != 1)}" if i < len(sizes) else "nothing"
