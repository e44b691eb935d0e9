"""The pipeline's bubble drawn: each rank's forwards, backwards and waits in one step.

    minddp pp-bench --world-sizes 2 --microbatches 4 --png docs/pp-bubble.png

A panel per schedule, a row per rank, from the intervals pp-bench recorded in a real run
(never a formula): forward, backward (B, or I and W) bars labelled by microbatch ("sF0",
stage s's, where a rank holds several stages), and on top of them, in grey, the time spent
waiting in recv. matplotlib as in pictures.py.
"""

from .pictures import _pyplot

PIPELINE_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868",
                   "recv": "#c8c8c8"}


def draw_pipeline(rows, path, machine):
    """Each rank's actions and waits in one step, a panel per schedule.

    rows: pp-bench's minddp rows of one world size and microbatch count, their recorded
    events. Returns {(schedule, rank): [(action, start ms, end ms)]} read back from the bars
    in the figure, each action as "sFi" (stage s, -1 for a recv; F, B, I, W; microbatch i).
    """
    plt = _pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.2 + 1.1 * len(rows) *
                                                    len(rows[0]["idle"])), squeeze=False)
    drawn = {}
    for ax, row in zip(axes[:, 0], rows):
        schedule = row["way"].split()[-1]
        stages = len(row["idle"])  # ranks
        several = row.get("stages per rank", 1) > 1
        for stage, events in enumerate(row["events"]):
            y = stages - 1 - stage  # rank 0 on top
            for sched, index, kind, i, start, end in events:
                if sched != schedule:
                    continue
                bar = ax.barh(y, (end - start) * 1e3, left=start * 1e3, height=0.7 if kind != "recv"
                              else 0.35, color=PIPELINE_COLORS[kind], edgecolor="white",
                              linewidth=0.5, zorder=3 if kind == "recv" else 2)  # waits on top
                bar.patches[0].set_gid(f"{schedule}|{stage}|{index}{kind}{i}")
                if kind != "recv" and (end - start) * 1e3 > 0:
                    label = f"{index}{kind}{i}" if several else f"{kind}{i}"
                    ax.text((start + end) / 2 * 1e3, y, label, ha="center",
                            va="center", fontsize=7, color="white", zorder=4)
        ax.set_yticks(range(stages), [f"rank {s}" for s in reversed(range(stages))])
        idle = " ".join(f"{v:.0%}" for v in row["idle"])
        ax.set_title(f"{schedule}, {stages} ranks, {row['m']} microbatches: idle per rank"
                     f" {idle} (laid out from the lists: {row['laid out']:.0%}); most"
                     f" activations alive per rank {' '.join(map(str, row['alive']))}",
                     fontsize=9, loc="left")
        ax.set_xlabel("ms from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=PIPELINE_COLORS[k]) for k in "FBW"]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=PIPELINE_COLORS["recv"]))
    axes[0, 0].legend(handles, ["forward", "backward (B, or I: the input's gradient)",
                                "W: the weights' gradients",
                                "waiting in recv (inside a forward or backward): idle"],
                      fontsize=7, loc="upper right")
    fig.text(0.99, 0.005, machine, ha="right", va="bottom", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    for ax in axes[:, 0]:
        for patch in ax.patches:
            if patch.get_gid():
                schedule, rank, action = patch.get_gid().split("|")
                drawn.setdefault((schedule, int(rank)), []).append(
                    (action, patch.get_x(), patch.get_x() + patch.get_width()))
    return drawn
