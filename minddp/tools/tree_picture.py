"""The invariant mode's picture: one tree of virtual shards on every dp, and what it costs.

    minddp invariant-bench --png docs/invariant.png

Left, the pairwise tree over 8 virtual shards (invariant/tree.py) as dp = 1, 2 and 4 ranks
run it: the leaves in the colour of the rank that computes them, each sum in the colour of
the rank that adds it, grey where the ranks add it together (chapter 0's halving-doubling).
Every dp draws the same tree: that is why the bits agree. Right, the measured price:
invariant-bench's median ratio of step times, invariant / normal, per mesh.
"""

from .pictures import _pyplot, save

RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
TOGETHER = "#999999"


def tree_nodes(leaves, ranks):
    """[(level, index, rank or None)]: every node of the pairwise tree over `leaves`, the rank
    whose aligned run of leaves holds it, None above the runs (added over the ranks)."""
    nodes, run, level, width = [], leaves // ranks, 0, leaves
    while width >= 1:
        span = leaves // width  # leaves under one node of this level
        nodes += [(level, i, i * span // run if span <= run else None) for i in range(width)]
        level, width = level + 1, width // 2
    return nodes


def draw_invariant(rows, path, machine, leaves=8):
    """rows: invariant-bench's (dicts with "mesh", "mode" and "ratio", invariant / normal).
    Returns {"tree": {dp: nodes}, "ratios": {mesh: bar height}} read back from the figure."""
    plt = _pyplot()
    fig, (tree, cost) = plt.subplots(1, 2, figsize=(12, 4.2), width_ratios=[1.3, 1])
    drawn = {"tree": {}, "ratios": {}}
    for row, ranks in enumerate((1, 2, 4)):
        y0 = (2 - row) * 5.0  # each dp its band, leaves at the bottom of it
        nodes = tree_nodes(leaves, ranks)
        for level, i, rank in nodes:
            x = (i + 0.5) * leaves / (leaves >> level)
            color = TOGETHER if rank is None else RANK_COLORS[rank]
            tree.scatter(x, y0 + level, s=90, color=color, zorder=2, gid=f"{ranks}|{level}|{i}")
            if level:  # the two children it adds
                for child in (2 * i, 2 * i + 1):
                    cx = (child + 0.5) * leaves / (leaves >> (level - 1))
                    tree.plot([cx, x], [y0 + level - 1, y0 + level], color=color, zorder=1)
        tree.text(-0.6, y0 + 1, f"dp={ranks}", ha="right", va="center", fontsize=10)
        drawn["tree"][ranks] = [(c.get_gid(), c.get_facecolor()[0][:3].tolist())
                                for c in tree.collections if c.get_gid()
                                and c.get_gid().startswith(f"{ranks}|")]
    for i in range(leaves):
        tree.text(i + 0.5, -0.7, f"shard {i}", ha="center", va="top", fontsize=7)
    handles = [plt.Line2D([0], [0], marker="o", linestyle="", color=c) for c in
               RANK_COLORS + [TOGETHER]]
    tree.legend(handles, [f"dp rank {r}" for r in range(4)] + ["over the ranks"], fontsize=7,
                loc="upper center", bbox_to_anchor=(0.55, 0.02), ncol=5, frameon=False)
    tree.set_xlim(-2.2, leaves + 0.2)
    tree.set_ylim(-2.6, 14)  # room below the shards for the legend
    tree.axis("off")
    tree.set_title(f"One tree over {leaves} virtual shards on every dp: leaves and sums coloured"
                   " by rank,\ngrey where the ranks add together (halving-doubling)",
                   fontsize=9, loc="left")
    timed = [r for r in rows if r["mode"] == "invariant"]
    bars = cost.bar(range(len(timed)), [r["ratio"] for r in timed], color="#8172b2")
    for bar, r in zip(bars, timed):
        bar.set_gid(r["mesh"])
        cost.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['ratio']:.2f}x",
                  ha="center", va="bottom", fontsize=8)
        drawn["ratios"][r["mesh"]] = bar.get_height()
    cost.axhline(1.0, color="black", linewidth=1, linestyle="dashed")
    cost.set_xticks(range(len(timed)), [r["mesh"] for r in timed], fontsize=8)
    cost.set_ylabel("step time, invariant / normal (median)")
    cost.set_title("The price per mesh (1 = the normal mode's step time)", fontsize=9, loc="left")
    save(fig, path, machine)
    plt.close(fig)
    return drawn
