"""The benchmarks: what each lesson costs, measured beside stock PyTorch in the same run.

For anyone who asks "and how fast is it?". One shared harness, then one benchmark per
lesson, each a `minddp` subcommand:
    harness.py      the models, one timed step, rounds in a shuffled order, ranks started
    transformer.py  the transformers they train: blocks for TP, a small GPT for the mesh
    ddp.py          `minddp bench`: no sync, naive, bucketed and stock DDP
    timeline.py     `minddp timeline`: when backward computes and each all-reduce runs
    collectives.py  `minddp collectives-bench`: chapter 0's collectives beside gloo's
    zero.py         `minddp zero-bench`: ZeRO-1's optimizer state per rank, step time
    fsdp.py         `minddp fsdp-bench`: ZeRO-1/2/3 and stock fully_shard, bytes and time
    stock_fsdp.py   stock fully_shard's private internals, read here and nowhere else
    tp.py           `minddp tp-bench`: tensor and sequence parallel against the formula
    pp.py           `minddp pp-bench`: the pipeline's bubble and activations per stage
    elastic.py      `minddp elastic-bench`: the ordered reduction beside all_reduce
    mesh.py         `minddp mesh-bench`: what each rank holds and sends per dimension
    invariant.py    `minddp invariant-bench`: the invariant mode's step time and memory
    recompute.py    `minddp recompute-bench`: the bytes a block keeps, by policy
    context.py      `minddp cp-bench`: who computes what, the bytes round the ring
    experts.py      `minddp ep-bench`: tokens per expert, the all_to_alls' bytes
Times are reported as ratios to stock's, never asserted by a test. Stock's private FSDP
internals, which the memory figures need, are read in one place.

This file holds what the runners need before torch is imported, so that a mistyped flag
is refused at once: the model sizes and the flags every benchmark shares.
"""

import argparse

from ..run.cli import ArgumentParser

SIZES = {"0.3M": (256, 4), "4M": (1024, 4), "17M": (2048, 4)}  # name: (width, layers) of an MLP
WIDTH, HEADS, TOKENS, BLOCKS = 256, 8, 64, 2  # the tensor-parallel benchmark's transformer


def at_least(low):
    """An argparse type: an int no smaller than `low` (a count of 0 would run nothing)."""
    def number(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    number.__name__ = "int"  # what argparse names in "invalid int value"
    return number


def bench_parser(doc, prog, default_world_sizes):
    """The flags every benchmark shares (parse with .parse_args(): a typo names the nearest)."""
    parser = ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.set_defaults(prog=prog)  # progress lines name the benchmark (harness.say)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--world-sizes", nargs="+", type=at_least(1), default=default_world_sizes,
                        help="started here, one after another (ignored under torchrun)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=at_least(1), default=64, help="rows per step and rank")
    parser.add_argument("--steps", type=at_least(1), default=1,
                        help="timed steps per contender per round")
    parser.add_argument("--rounds", type=at_least(1), default=60,
                        help="rounds of alternating contenders")
    parser.add_argument("--warmup", type=at_least(0), default=3,
                        help="untimed steps per contender first")
    parser.add_argument("--threads", type=at_least(0), default=0,
                        help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--format", default="simple", help="tabulate format, e.g. github for docs")
    return parser


def check_outputs(args, *flags):
    """Before any rank starts, one line and exit 2 for --png without matplotlib, or an output
    flag's path that cannot be written. Returns args."""
    from ..run.cli import check_output_path
    from ..run.errors import exit_on_usage_error
    from ..tools.pictures import require_matplotlib
    with exit_on_usage_error():
        if getattr(args, "png", None):
            require_matplotlib()
        for flag in flags:
            if getattr(args, flag, None):
                check_output_path(getattr(args, flag), f"--{flag}")
    return args
