"""Pictures: the overlap timeline and the memory each ZeRO stage keeps per rank, as PNG files.

    minddp timeline --size 17M --world-size 2 --png docs/timeline.png
    minddp timeline --trace runs/lesson.json --png runs/lesson.png
    minddp fsdp-bench --png docs/zero-memory.png

Both draw measurements, never a formula: the timeline the recorded events of one step,
the memory bars the bytes fsdp_bench counted on each rank. matplotlib is optional
(pip install -e ".[plot]"); require_matplotlib() says so in one line when it is missing.
Each draw function returns what it drew, read back from the figure, so that a test can
compare the picture with the measurements.
"""

from ..launch.usage_error import UsageError
from .overlap import COMM, COMPUTE

COLORS = {"backward": "#4c72b0", "blocked": "#c44e52", "optimizer step": "#8172b2",
          "all-reduce": "#55a868", "params": "#4c72b0", "grads": "#dd8452",
          "optimizer": "#55a868", "gathered": "#c44e52"}
COMM_SHADES = ["#55a868", "#2f7d45"]  # neighbouring all-reduces told apart


def require_matplotlib(flag="--png"):
    """Raise UsageError (exit 2, one line) unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib, which is not installed",
                         hint='pip install -e ".[plot]"  (or: pip install matplotlib)') from None


def save(fig, path, machine):
    """The machine line in the corner, laid out, written to `path`, closed."""
    fig.text(0.99, 0.005, machine, ha="right", va="bottom", fontsize=6, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: no window, no display needed
    import matplotlib.pyplot as plt
    return plt


def step_spans(events, step):
    """One rank's step as (track, label, start us, end us) bars: what the timeline draws."""
    mine = [e for e in events if e["step"] == step]
    spans = []
    starts = [e["ts"] for e in mine if e["name"] == "backward starts"]
    grads = [e["ts"] for e in mine if e["name"].startswith("grad ")]
    if starts and grads:
        spans.append((COMPUTE, "backward", min(starts), max(grads)))
    for e in mine:
        if e["dur"] <= 0:
            continue
        if e["args"].get("blocked"):
            spans.append((COMPUTE, "blocked", e["ts"], e["ts"] + e["dur"]))
        elif e["name"] == "optimizer step":
            spans.append((COMPUTE, "optimizer step", e["ts"], e["ts"] + e["dur"]))
        elif e["track"] == COMM:
            spans.append((COMM, e["name"], e["ts"], e["ts"] + e["dur"]))
    return spans


CAPTION = ("An all-reduce bar runs from its launch to its completion, waiting for the slower rank"
           " included.\nStock's white gap before the optimizer step: its C++ reducer waiting for"
           " the buckets and copying them back,\nunseen by the recorder (minddp's wait is the red"
           " bar). Overlap: the share of all-reduce time while backward computed.")


def draw_timeline(panels, path, machine):
    """panels: [(title, everyone's events, step)], drawn one above the other into PNG `path`.

    Per rank two rows, compute (backward, blocked, optimizer step) and communication (each
    all-reduce from launch to completion, labelled); time in ms from the step's first event.
    The ranks share one clock (time.perf_counter on one machine).
    Returns [(panel, rank, track, label, start ms, length ms)] read back from the figure.
    """
    plt = _pyplot()
    world = max(len(everyone) for _, everyone, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.0 + 1.1 * world * len(panels)),
                             squeeze=False)
    drawn = []
    for i, (ax, (title, everyone, step)) in enumerate(zip(axes[:, 0], panels)):
        spans = {r: step_spans(evs, step) for r, evs in enumerate(everyone)}
        # One clock for all ranks of a machine: time 0 is the step's first event on any rank.
        t0 = min((e["ts"] for evs in everyone for e in evs if e["step"] == step), default=0.0)
        rows, labels = {}, []
        for rank in range(len(everyone)):
            for track in (COMPUTE, COMM):
                rows[(rank, track)] = len(labels)
                labels.append(f"rank {rank} {'compute' if track == COMPUTE else 'comm'}")
        for rank, ss in spans.items():
            comm = [span for span in ss if span[0] == COMM]
            lanes = _lanes(comm)
            for span in ss:
                track, label, a, b = span
                y = len(labels) - 1 - rows[(rank, track)]
                lane, count = lanes.get(span, (0, 1))
                height = 0.8 / count  # all-reduces in flight together share the row
                bottom = y - 0.4 + lane * height
                color = COMM_SHADES[comm.index(span) % 2] if track == COMM else COLORS[label]
                bar = ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3)], (bottom, height),
                                     facecolors=color, edgecolor="white", linewidth=0.3)
                bar.set_gid(f"{i}|{rank}|{track}|{label}")  # read back below
                if track == COMM:
                    short = label.replace("bucket ", "b").replace("param ", "p")
                    ax.text((a - t0) / 1e3, bottom + height / 2, short, va="center",
                            fontsize=6, clip_on=True)
        for bar in ax.collections:
            if bar.get_gid():
                panel, rank, track, label = bar.get_gid().split("|")
                xs = bar.get_paths()[0].vertices[:, 0]
                drawn.append((int(panel), int(rank), track, label, xs.min(), xs.max() - xs.min()))
        ax.set_yticks(range(len(labels)), labels[::-1], fontsize=7)
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlabel("ms from the step's first event (any rank)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(left=0)
    fig.text(0.99, 0.005, machine, ha="right", va="bottom", fontsize=6, color="gray")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               (COLORS["backward"], COLORS["blocked"], COLORS["optimizer step"], *COMM_SHADES)]
    fig.legend(handles, ["backward computing", "blocked (waiting)", "optimizer step",
                         "all-reduce, launch to completion", "(the next one, a darker green)"],
               loc="upper right", fontsize=7, ncol=5, frameon=False)
    fig.text(0.01, 0.005, CAPTION, ha="left", va="bottom", fontsize=6.5)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _lanes(comm):
    """{span: (lane, lanes)}: all-reduces in flight together stacked in the row, none hidden."""
    ends, lane_of = [], {}
    for span in sorted(comm, key=lambda span: span[2]):
        free = [n for n, end in enumerate(ends) if end <= span[2]]
        lane = free[0] if free else len(ends)
        if lane == len(ends):
            ends.append(span[3])
        else:
            ends[lane] = span[3]
        lane_of[span] = lane
    return {span: (lane, len(ends)) for span, lane in lane_of.items()}


SEGMENTS = ["params", "grads", "optimizer", "gathered"]
LABELS = {"FSDP no reshard": "ZeRO-2-like\nminddp", "stock no reshard": "ZeRO-2-like\nstock",
          "FSDP": "ZeRO-3\nminddp", "stock fully_shard": "ZeRO-3\nstock"}


def memory_bars(rows):
    """{(ranks, way): {segment: MB}} from fsdp_bench's rows: what the memory picture stacks.

    'gathered' is the peak of whole weights beyond what the rank holds anyway: for DDP and
    ZeRO-1 the weights are whole all the time (0 beyond params); for FSDP the gathered units.
    """
    bars = {}
    for r in rows:
        gathered = 0.0 if r["way"] in ("DDP", "ZeRO-1") else r["unsharded"]
        bars[(r["ranks"], r["way"])] = {"params": r["params"], "grads": r["grads"],
                                        "optimizer": r["optimizer"], "gathered": gathered}
    return bars


def draw_held_and_activations(rows, path, machine, title, caption):
    """draw_memory for rows of params, grads, optimizer and activations MB (tp-bench's,
    mesh-bench's): the activations autograd saves stand where the gathered weights stood."""
    bars = {(r["ranks"], r["way"]): {"params": r["params"], "grads": r["grads"],
                                     "optimizer": r["optimizer"], "gathered": r["activations"]}
            for r in rows}
    return draw_memory(rows, path, machine, bars=bars, title=title, caption=caption,
                       legend=["parameters (P)", "gradients (G)", "optimizer state (O)",
                               "activations saved for backward"])


def draw_memory(rows, path, machine, bars=None, legend=None, title=None, caption=None):
    """Stacked bars per world size and way, one model; the ideal (P+G+O)/W as a mark.

    rows: fsdp_bench's (or tp_bench's, with its own `bars`, `legend`, `title`, `caption`).
    Returns {(ranks, way): {segment: height}} read back from the bars in the figure.
    """
    plt = _pyplot()
    bars = bars or memory_bars(rows)
    sizes = sorted({r["ranks"] for r in rows})
    ways = list(dict.fromkeys(r["way"] for r in rows))
    fig, ax = plt.subplots(figsize=(13, 4.2))
    x, ticks, labels, keys = 0.0, [], [], []
    for w_i, world in enumerate(sizes):
        first = x
        for way in ways:
            if (world, way) not in bars:
                continue
            bottom = 0.0
            for segment in SEGMENTS:
                height = bars[(world, way)][segment]
                rect = ax.bar(x, height, bottom=bottom, width=0.8, color=COLORS[segment],
                              label=segment if not keys else None)
                rect.patches[0].set_gid(f"{world}|{way}|{segment}")
                bottom += height
            keys.append((world, way))
            ticks.append(x)
            labels.append(LABELS.get(way, way))
            x += 1
        ddp = bars.get((world, "DDP"))
        if ddp:  # everything DDP holds, split evenly: what perfect sharding would leave
            ideal = (ddp["params"] + ddp["grads"] + ddp["optimizer"]) / world
            ax.hlines(ideal, first - 0.45, x - 0.55, colors="black", linestyles="dashed",
                      linewidth=1, label="ideal" if w_i == 0 else None)
            ax.text(x - 0.5, ideal, " (P+G+O)/W", va="bottom", fontsize=7)
        ax.text((first + x - 1) / 2, -0.2, f"{world} rank{'s' if world > 1 else ''}",
                ha="center", va="top", transform=ax.get_xaxis_transform(), fontsize=9)
        x += 0.8 if w_i < len(sizes) - 1 else 0
    ax.set_xticks(ticks, labels, fontsize=6.5)
    ax.set_xlim(-0.6, x + 0.6)  # room for the last mark's label
    ax.set_ylabel("MB per rank (largest rank)")
    ax.set_title(title or f"What each rank holds: {rows[0]['model']} MLP, AdamW (minddp's and"
                          f" stock's side by side)", fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[s]) for s in SEGMENTS]
    names = legend or ["parameters (P)", "gradients (G)", "optimizer state (O)",
                       "whole weights gathered (peak)"]
    if any(way == "DDP" for _, way in bars):  # the ideal mark is drawn beside DDP's bars
        handles.append(plt.Line2D([0], [0], color="black", linestyle="dashed", linewidth=1))
        names = names + ["(P+G+O)/W: DDP's P+G+O split evenly over W ranks"]
    ax.legend(handles, names, fontsize=7, loc="upper right")
    fig.text(0.01, 0.005, caption or "At 1 rank ZeRO-2/3 shard nothing and still gather (copy)"
             " each unit: their bars stand above DDP's by that copy. Bytes measured on the"
             " largest rank.", ha="left", va="bottom", fontsize=7)
    fig.text(0.99, 0.005, machine, ha="right", va="bottom", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.subplots_adjust(bottom=0.25)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    drawn = {}
    for patch in ax.patches:
        if patch.get_gid():
            world, way, segment = patch.get_gid().split("|")
            drawn.setdefault((int(world), way), {})[segment] = patch.get_height()
    return drawn
