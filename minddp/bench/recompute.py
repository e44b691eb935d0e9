"""Recomputation measured: the bytes a block keeps for backward, and what recomputing costs.

    minddp recompute-bench                               # both tables, one process
    minddp recompute-bench --png docs/recompute-memory.png --format github

The benchmark's transformer block (bench/transformer.py: pre-LN, causal attention with
scaled_dot_product_attention, a 4x MLP, residual dropout 0.1), fp32, on one process:

  kept       per policy (none, full, selective: minddp.memory.recompute.POLICIES) and for minddp's
             checkpoint_module and stock's composable checkpoint: the bytes of every tensor
             alive after the block's forward that its backward will use, the block's input
             included, its output not (found by tracking each op's outputs with a dispatch
             mode, then asking which are still alive: measured, not counted from a formula)
  formula    the same bytes from the block's ops (minddp memory's): none 72sbh + 16sb +
             4asb (the Playbook's 34sbh + 5as^2b in its fp32 form, 66sbh + 9as^2b, with three
             differences: dropout's mask is a float32 tensor on CPU, 4 bytes and not 1; flash
             attention keeps no s^2 scores, only a logsumexp per row, 4asb; the LayerNorms' mean and
             rstd, 16sb, which the Playbook leaves out); full 4sbh (the input); selective
             44sbh + 4asb (the input and every matmul's and attention's output)
  cost       --blocks blocks of --width, a step (forward, backward) of each policy and
             implementation in rotating rounds: the median time as a ratio to no
             recomputation's; and the FLOPs backward runs beyond no recomputation's, as a
             share of the forward's (torch.utils.flop_counter, which counts the matmuls
             and attention only: minddp's checkpoint, which runs the same ops as stock's)
--png draws kept bytes per block against the sequence length, one line per policy.
"""

from . import at_least
from ..run.cli import ArgumentParser


def parse(argv=None):
    parser = ArgumentParser(prog="minddp recompute-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=at_least(8), default=256, help="h, the model width")
    parser.add_argument("--heads", type=at_least(1), default=8, help="a, attention heads")
    parser.add_argument("--sequence", type=at_least(1), default=256, help="s, tokens")
    parser.add_argument("--batch", type=at_least(1), default=4, help="b, sequences")
    parser.add_argument("--blocks", type=at_least(1), default=4, help="blocks timed")
    parser.add_argument("--rounds", type=at_least(1), default=10)
    parser.add_argument("--png", metavar="PATH", help="kept bytes vs sequence length (matplotlib)")
    parser.add_argument("--format", default="simple", help="tabulate format, e.g. github")
    from . import check_outputs
    return check_outputs(parser.parse_args(argv), "png")


if __name__ == "__main__":
    ARGS = parse()  # before torch loads: a typo costs a moment


import gc  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from ..references.libraries import stock_checkpoint_module  # noqa: E402
from ..memory.recompute import POLICIES, checkpoint_module  # noqa: E402
from ..tools.memory import activation_bytes  # noqa: E402
from .transformer import Block  # noqa: E402

IMPLS = {"minddp": checkpoint_module, "stock": stock_checkpoint_module}


def formula(policy, s, b, h, a):
    """Bytes one block keeps for backward (fp32, dropout on): the memory planner's."""
    return activation_bytes(SimpleNamespace(sequence=s, micro_batch=b, hidden=h, heads=a, tp=1,
                                            activations="cpu", dropout=True,
                                            recompute=policy))


class Outputs(TorchDispatchMode):
    """Weak references to every tensor an op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.made.append(weakref.ref(o))
        return out


def block(policy, impl, h, a, seed=0):
    torch.manual_seed(seed)
    module = Block(h, a, dropout=0.1)
    if POLICIES[policy] is not None:
        IMPLS[impl](module, POLICIES[policy])
    return module


def kept_bytes(module, s, b, h, settle_s=0.0):
    """Bytes of the storages alive after module's forward, its input's included (freed by the
    caller: what stays is what backward holds), its output's and the weights' not. With
    collectives in the forward: the least of the counts taken over `settle_s` seconds."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    x = torch.randn(b, s, h, requires_grad=True)
    with Outputs() as outputs:
        y = module(x)
    refs = [weakref.ref(x), *outputs.made]
    del x
    gc.collect()
    skip = weights | {y.untyped_storage().data_ptr(), 0}  # the weights', the output's, none

    def count():
        alive = {}
        for t in (t for t in (r() for r in refs) if t is not None):
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                alive[storage.data_ptr()] = storage.nbytes()
        return sum(alive.values())
    # A collective's tensor can outlive it by a moment: a TP block at 2 ranks beside two busy
    # loops counted 2048 bytes more (the 4x8x16 float32 partial sum the row split
    # all_reduces; gloo's worker thread lets go of a work after it completes) in 34 of 600
    # counts, none with 0.2 s of counts. Such a reference only adds: the least count is right.
    least, deadline = count(), time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(0.01)
        least = min(least, count())
    return least


def memory_rows(args):
    s, b, h, a = args.sequence, args.batch, args.width, args.heads
    rows = []
    for policy in POLICIES:
        kept = {impl: kept_bytes(block(policy, impl, h, a), s, b, h) for impl in IMPLS}
        rows.append({"policy": policy, **kept, "formula": formula(policy, s, b, h, a),
                     "per sbh": kept["minddp"] / (s * b * h)})
    return rows


def step(model, x):
    model(x).square().mean().backward()


def cost_rows(args):
    s, b, h, a = args.sequence, args.batch, args.width, args.heads
    ways = [(policy, impl) for policy in POLICIES for impl in IMPLS
            if policy != "none" or impl == "minddp"]
    models = {way: torch.nn.Sequential(*(block(*way, h, a, seed=i) for i in range(args.blocks)))
              for way in ways}
    x = torch.randn(b, s, h, requires_grad=True)
    flops = {}
    for way, model in models.items():
        if way[1] == "minddp":  # (stock's selective checkpoint refuses to run under the
            # counter: it counts each op's calls, and the counter's dispatch adds some)
            with torch.no_grad(), FlopCounterMode(display=False) as forward:
                model(x)
            y = model(x)
            with FlopCounterMode(display=False) as backward:
                y.square().mean().backward()
            flops[way[0]] = forward.get_total_flops(), backward.get_total_flops()
        step(model, x)  # warm-up
    times = {way: [] for way in ways}
    for r in range(args.rounds):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:  # each first in turn
            start = time.perf_counter()
            step(models[way], x)
            times[way].append(time.perf_counter() - start)
    base = statistics.median(times["none", "minddp"])
    return [{"policy": p, "impl": i, "ms": statistics.median(times[p, i]) * 1e3,
             "vs none": statistics.median(times[p, i]) / base,
             "extra": (flops[p][1] - flops["none"][1]) / flops[p][0]}
            for p, i in ways]


def machine():
    return (f"torch {torch.__version__} | {os.cpu_count()} CPUs {platform.machine()} |"
            f" {torch.get_num_threads()} threads")


def main(args):
    s, b, h, a = args.sequence, args.batch, args.width, args.heads
    print(f"{machine()} | one block, fp32, dropout 0.1 | s={s} b={b} h={h} a={a}")
    print(tabulate([[r["policy"], r["minddp"], r["stock"], r["formula"], f"{r['per sbh']:.3f}"]
                    for r in memory_rows(args)],
                   headers=["policy", "kept bytes, minddp", "kept bytes, stock", "formula",
                            "minddp / sbh"], tablefmt=args.format, disable_numparse=True))
    print(f"\n{args.blocks} blocks, {args.rounds} rounds: a step (forward and backward)")
    print(tabulate([[r["policy"], r["impl"], f"{r['ms']:.2f}", f"{r['vs none']:.2f}x",
                     f"{r['extra']:.0%}"] for r in cost_rows(args)],
                   headers=["policy", "checkpoint", "median ms/step", "vs none",
                            "matmul FLOPs run again, of the forward's"],
                   tablefmt=args.format, disable_numparse=True))
    if args.png:
        draw(args)
        print(f"picture: {args.png}")


def draw(args):
    from ..tools.pictures import _pyplot
    plt = _pyplot()
    b, h, a = args.batch, args.width, args.heads
    lengths = [64, 128, 256, 512, 1024, 2048]
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in POLICIES:
        mib = [kept_bytes(block(policy, "minddp", h, a), s, b, h) / 2**20 for s in lengths]
        ax.plot(lengths, mib, marker="o", label=f"{policy} (measured)")
    # The Playbook's none, fp32 form: attention that keeps its s x s scores (not flash)
    ax.plot(lengths, [(66 * s * b * h + 9 * a * s * s * b) / 2**20 for s in lengths], "--",
            color="gray", label="none, the Playbook's 66sbh + 9as²b (scores kept)")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("MiB kept for backward, one block")
    ax.set_yscale("log")
    ax.set_title(f"activations one block keeps: b={b}, h={h}, a={a}, fp32", fontsize=9)
    ax.legend()
    fig.text(0.99, 0.005, machine(), ha="right", va="bottom", fontsize=6, color="gray")
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(ARGS)
