"""Reading a timeline: the overlap figure, and a text picture of one step.

    minddp timeline --size 17M --world-size 2

`events` are one rank's records from minddp.timeline (dicts: step, track, name, ts, dur in
microseconds, args). The overlap figure is the share of a step's communication time that
ran while backward was computing (from its start to the last gradient's arrival) and not
blocked: time that communication cost nothing, because compute went on.
"""

COMPUTE, COMM = "compute", "communication"


def _merge(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _length_inside(intervals, windows):
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in windows)


def overlap(events, step):
    """Share of this step's communication time that ran while backward computed, unblocked."""
    mine = [e for e in events if e["step"] == step]
    starts = [e["ts"] for e in mine if e["name"] == "backward starts"]
    grads = [e["ts"] for e in mine if e["name"].startswith("grad ")]
    comm = _merge([(e["ts"], e["ts"] + e["dur"]) for e in mine if e["track"] == COMM])
    total = sum(b - a for a, b in comm)
    if not starts or not grads or total == 0:
        return None
    computing = [(min(starts), max(grads))]  # backward, until the last gradient arrived
    blocked = _merge([(e["ts"], e["ts"] + e["dur"]) for e in mine if e["args"].get("blocked")])
    while_computing = _pieces_inside(comm, computing)
    busy = sum(b - a for a, b in while_computing) - _length_inside(while_computing, blocked)
    return busy / total


def _pieces_inside(intervals, windows):
    return [(max(a, c), min(b, d))
            for a, b in intervals for c, d in windows if min(b, d) > max(a, c)]


def text_timeline(everyone, step, width=72):
    """Rows per rank and track, time across: = computing, B blocked, O optimizer, digits buckets."""
    events = [(r, e) for r, evs in enumerate(everyone) for e in evs if e["step"] == step]
    if not events:
        return "(no events)"
    t0 = min(e["ts"] for _, e in events)
    t1 = max(e["ts"] + e["dur"] for _, e in events)
    scale = width / max(t1 - t0, 1.0)
    col = lambda t: min(width - 1, int((t - t0) * scale))  # noqa: E731
    lines = [f"step {step}: {(t1 - t0) / 1000:.1f} ms across,"
             f" one column = {(t1 - t0) / width / 1000:.2f} ms"]
    for rank, evs in enumerate(everyone):
        mine = [e for e in evs if e["step"] == step]
        compute, comm = [" "] * width, [" "] * width
        starts = [e["ts"] for e in mine if e["name"] == "backward starts"]
        grads = [e["ts"] for e in mine if e["name"].startswith("grad ")]
        if starts and grads:
            for c in range(col(min(starts)), col(max(grads)) + 1):
                compute[c] = "="
        for e in mine:
            span = range(col(e["ts"]), col(e["ts"] + e["dur"]) + 1)
            if e["args"].get("blocked"):
                for c in span:
                    compute[c] = "B"
            elif e["name"] == "optimizer step":
                for c in span:
                    compute[c] = "O"
            elif e["track"] == COMM:
                mark = e["name"].split()[-1][-1]
                for c in span:
                    comm[c] = mark
        lines.append(f"rank {rank} compute |{''.join(compute)}|")
        lines.append(f"rank {rank} comm    |{''.join(comm)}|")
    return "\n".join(lines)
