"""The pipeline's bubble drawn: each stage's forwards, backwards and waits in one step.

    minddp pp-bench --world-sizes 2 --microbatches 4 --png docs/pp-bubble.png

A panel per schedule (GPipe above 1F1B), a row per stage, from the intervals pp-bench
recorded in a real run (never a formula): forward and backward bars labelled by microbatch,
and on top of them, in grey, the time spent waiting in recv. matplotlib as in pictures.py.
"""

from .pictures import _pyplot

PIPELINE_COLORS = {"F": "#4c72b0", "B": "#dd8452", "recv": "#c8c8c8"}


def draw_pipeline(rows, path, machine):
    """Each stage's forwards, backwards and waits in one step, a panel per schedule.

    rows: pp-bench's minddp rows of one world size and microbatch count, their recorded
    events. Returns {(schedule, stage): [(kind, microbatch, start ms, end ms)]} read back
    from the bars in the figure.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.2 + 1.1 * len(rows) *
                                                    len(rows[0]["idle"])), squeeze=False)
    drawn = {}
    for ax, row in zip(axes[:, 0], rows):
        schedule = row["way"].split()[-1]
        stages = len(row["idle"])
        for stage, events in enumerate(row["events"]):
            y = stages - 1 - stage  # stage 0 on top
            for sched, kind, i, start, end in events:
                if sched != schedule:
                    continue
                bar = ax.barh(y, (end - start) * 1e3, left=start * 1e3, height=0.7 if kind != "recv"
                              else 0.35, color=PIPELINE_COLORS[kind], edgecolor="white",
                              linewidth=0.5, zorder=3 if kind == "recv" else 2)  # waits on top
                bar.patches[0].set_gid(f"{schedule}|{stage}|{kind}|{i}")
                if kind != "recv" and (end - start) * 1e3 > 0:
                    ax.text((start + end) / 2 * 1e3, y, f"{kind}{i}", ha="center",
                            va="center", fontsize=7, color="white", zorder=4)
        ax.set_yticks(range(stages), [f"stage {s}" for s in reversed(range(stages))])
        idle = " ".join(f"{v:.0%}" for v in row["idle"])
        ax.set_title(f"{schedule.upper()}, {stages} stages, {row['m']} microbatches: idle per"
                     f" stage {idle} (formula (p-1)/(m+p-1) = {row['formula']:.0%});"
                     f" most microbatches alive per stage {' '.join(map(str, row['alive']))}",
                     fontsize=9, loc="left")
        ax.set_xlabel("ms from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PIPELINE_COLORS.values()]
    axes[0, 0].legend(handles, ["forward", "backward",
                                "waiting in recv (inside a forward or backward): idle"],
                      fontsize=7, loc="upper right")
    fig.text(0.99, 0.005, machine, ha="right", va="bottom", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    for ax in axes[:, 0]:
        for patch in ax.patches:
            if patch.get_gid():
                schedule, stage, kind, i = patch.get_gid().split("|")
                drawn.setdefault((schedule, int(stage)), []).append(
                    (kind, int(i), patch.get_x(), patch.get_x() + patch.get_width()))
    return drawn
