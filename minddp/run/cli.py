"""The examples' command line: the flags they share, checked before any training starts.

    python examples/manual_ddp.py --help

A bad flag should cost a student one line and a hint, not a finished run that then
fails to write its table, or a run that trains nothing and says "accuracy 0.5".
So every flag is checked right after parsing, on every rank alike, before the process
group exists: counts must be at least 1, and every output path must sit in a directory
that exists and is writable (minddp never creates directories behind your back).
"""

import argparse
import difflib
import importlib.metadata
import os
import signal
import tempfile
import threading

from ..launch.usage_error import UsageError
from .errors import exit_on_usage_error, interrupted, rank_0_speaks_first


class ArgumentParser(argparse.ArgumentParser):
    """argparse, answering a mistake in one line and a hint, with the nearest flag: exit 2.

    Import it without torch (it needs none): every runner and example parses its flags
    before torch loads, so a typo is refused in a moment even on a busy machine.
    """

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized argument {unknown[0]!r}", unknown[0])
        return parsed

    def parse_known_args(self, args=None, namespace=None):
        if threading.current_thread() is threading.main_thread():
            # Ctrl-C from here on, during torch's import too: one line and status 130, not a
            # traceback (run/errors.py; exit_on_failure keeps it while training)
            signal.signal(signal.SIGINT, interrupted)
        refusal = torch_too_old()
        if refusal:  # every rank stops; rank 0 says why, once
            if os.environ.get("RANK", "0") != "0":
                rank_0_speaks_first()
                self.exit(2)
            self.exit(2, refusal)
        return super().parse_known_args(args, namespace)

    def error(self, message, given=None):
        close = difflib.get_close_matches((given or "").split("=")[0], self.flags(), n=1)
        hint = (f"did you mean {close[0]}? " if close else "") + f"{self.prog} --help lists them"
        self.exit(2, f"error: {message}\n---> HINT: {hint}\n")

    def flags(self):
        return [o for action in self._actions for o in action.option_strings]


OLDEST_TORCH = (2, 11)  # docs/tests.md: the versions tried, and why not older


def torch_version():
    """The installed torch's (major, minor) and its version string, read without importing it."""
    try:
        text = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None, None
    return tuple(int(part) for part in text.split(".")[:2]), text


def torch_too_old():
    """The refusal (one line and a hint) where the installed torch is older than minddp's floor."""
    found, text = torch_version()
    if found is None or found >= OLDEST_TORCH:
        return None
    floor = ".".join(map(str, OLDEST_TORCH))
    return (f"error: minddp needs torch {floor} or later, found {text}\n---> HINT: pip install"
            f" 'torch>={floor}' (the oldest release the suite runs on: docs/tests.md,"
            " which torch)\n")


def lesson_parser(doc, timeline=False, accumulate=False, restart=False, fsdp=False, zero=False,
                  tp=False, pp=False, elastic=False):
    """An ArgumentParser with the examples' flags; parse it with parse_checked().

    timeline, accumulate, restart, fsdp, zero, tp, pp, elastic: add the flags of the examples
    with those features (fsdp.py, tp.py and pipeline.py have no --check-replicas: their ranks hold
    different slices).
    """
    parser = ArgumentParser(description=doc.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--seed", type=int, default=123,
                        help="torch.manual_seed before data and model")
    parser.add_argument("--factor", type=int, default=1,
                        help="enlarge the 5-example training set this many times"
                             " (the lesson's factor)")
    parser.add_argument("--grad-table", metavar="PATH", help="record every synced gradient to PATH")
    if timeline:
        parser.add_argument("--timeline", metavar="PATH",
                            help="record backward and each bucket's all-reduce"
                                 " to a Chrome trace at PATH")
    if timeline or accumulate or restart:  # the examples that wrap with BucketedDDP
        parser.add_argument("--collectives", default="torch", choices=["torch", "minddp"],
                            help="whose all_reduce minddp's DDP classes call: torch's, or"
                                 " chapter 0's, by hand from send/recv (minddp/collectives/);"
                                 " stock DDP's C++ reducer calls gloo's either way")
    if tp:
        parser.add_argument("--tp", default="manual", choices=["manual", "stock"],
                            help="split with minddp's parallelize_module or stock PyTorch's")
    elif pp:
        parser.add_argument("--pp", default="manual", choices=["manual", "stock"],
                            help="run the stages with minddp.pp or stock"
                                 " torch.distributed.pipelining")
        parser.add_argument("--schedule", default="1f1b", choices=[
                                "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb1p",
                                "zbv", "dualpipev"],
                            help="the order of each stage's forwards and backwards (the last"
                                 " five: 2 stages per rank, pp/interleaved.py)")
        parser.add_argument("--microbatches", type=int, default=2, metavar="M",
                            help="microbatches per batch (the batch of 4 must divide by it)")
        parser.set_defaults(factor=4)  # 20 examples: 5 batches of 4 per epoch
    elif not fsdp:
        parser.add_argument("--check-replicas", action="store_true",
                            help="after every optimizer step, check that all ranks"
                                 " hold the same weights")
    else:
        parser.add_argument("--fsdp", default="manual", choices=["manual", "stock"],
                            help="shard with minddp's fully_shard or stock PyTorch's")
    parser.add_argument("--timeout", type=float, default=120, metavar="S",
                        help="seconds a rank waits in a collective for its peers before failing")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="auto: nccl with one GPU per process, else gloo")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto: cuda:LOCAL_RANK with nccl, mps for one process on a Mac,"
                             " else cpu")
    if zero:
        parser.add_argument("--zero", default="manual", choices=["manual", "stock"],
                            help="shard with minddp's ShardedOptimizer or stock PyTorch's"
                                 " ZeroRedundancyOptimizer")
    if accumulate or restart:
        parser.add_argument("--ddp", default="manual", choices=["manual", "stock"],
                            help="wrap with minddp's BucketedDDP or stock PyTorch's DDP")
    if accumulate:
        parser.add_argument("--accumulate", type=int, default=2, metavar="K",
                            help="micro-batches per optimizer step")
        parser.set_defaults(factor=4)  # 1 batch per rank and epoch would leave nothing to add up
    if restart:
        parser.add_argument("--checkpoint", metavar="PATH", required=True,
                            help="save after every epoch; if PATH exists at start, resume from it")
        parser.add_argument("--crash-at-step", type=int, metavar="K",
                            help="one rank exits abruptly as step K (from 1) begins,"
                                 " first attempt only")
        parser.add_argument("--crash-rank", type=int, metavar="R",
                            help="the rank that crashes (default: the last)")
    if elastic:
        parser.add_argument("--checkpoint-dir", metavar="DIR", required=True,
                            help="save after every step into DIR; at start, resume from DIR's"
                                 " newest checkpoint, whatever world size wrote it")
        parser.add_argument("--reduce", default="ordered", choices=["ordered", "plain", "stock"],
                            help="ordered: each virtual shard's gradient alone, added in shard"
                                 " order (the same bits at any world size); plain: minddp's"
                                 " BucketedDDP; stock: PyTorch's DDP")
        parser.add_argument("--global-batch", type=int, default=12, metavar="G",
                            help="samples per optimizer step, at every world size")
        parser.add_argument("--virtual-shards", type=int, default=12, metavar="N",
                            help="--reduce ordered: the global batch's fixed pieces")
        parser.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                            help="sleep S seconds after each step (time to stop a node)")
        parser.add_argument("--hold-file", metavar="PATH",
                            help="before each step, wait while PATH holds a smaller step number"
                                 " (lines up a node's loss or join with a known step)")
        parser.set_defaults(factor=8, epochs=4)  # 40 examples: 3 steps of 12 per epoch
    return parser


def run_flags(parser):
    """The flags the mesh examples (gpt_nd.py, context.py, experts.py) share after their own:
    --seed, --grad-table, --timeout, --backend, --device. Returns the parser."""
    parser.add_argument("--seed", type=int, default=123,
                        help="torch.manual_seed before the model")
    parser.add_argument("--grad-table", metavar="PATH",
                        help="record every rank's whole gradients")
    parser.add_argument("--timeout", type=float, default=120, metavar="S",
                        help="seconds a rank waits in a collective for its peers before failing")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    return parser


# Flags that name a file the run writes, and flags that count something.
OUTPUT_FLAGS = ("grad_table", "checkpoint", "timeline", "out")
AT_LEAST_ONE = ("epochs", "factor", "accumulate", "microbatches", "global_batch",
                "virtual_shards", "steps", "batch", "dp", "tokens", "experts", "blocks")


# Flags that each moved out of the lesson's examples into an example of their own.
MOVED = {"--accumulate": "accumulate.py", "--checkpoint": "restart.py",
         "--crash-at-step": "restart.py", "--crash-rank": "restart.py",
         "--timeline": "manual_ddp.py"}


def parse_checked(parser, argv=None):
    """parse_args(), then refuse what cannot work: one line, a hint, exit 2 (once, not per rank).

    It needs no torch: call it first, and a typo is refused before torch is imported.
    """
    with exit_on_usage_error():
        return _checked(parser, argv)


def _checked(parser, argv):
    args, unknown = parser.parse_known_args(argv)
    for arg in unknown:
        flag = arg.split("=")[0]
        if flag in MOVED:
            raise UsageError(f"{flag} is not a flag of this example:"
                             f" it lives in examples/{MOVED[flag]}",
                             hint=f"torchrun --nproc_per_node=2 examples/{MOVED[flag]} {flag} ...",
                             same_on_every_rank=True)
    if unknown:
        # Said once (not once per rank under torchrun), with the nearest flag this example has.
        close = difflib.get_close_matches(unknown[0].split("=")[0], parser.flags(), n=1)
        raise UsageError(f"unrecognized argument {unknown[0]!r}",
                         hint=(f"did you mean {close[0]}? " if close else "")
                         + f"{parser.prog} --help lists the flags", same_on_every_rank=True)
    if args.timeout <= 0:  # gloo would fail deep in C++ (0: at the first collective, <0: at once)
        raise UsageError(f"--timeout {args.timeout:g}: must be more than 0 seconds",
                         hint="e.g. --timeout 120", same_on_every_rank=True)
    for name in AT_LEAST_ONE:
        value = getattr(args, name, None)
        if isinstance(value, int) and value < 1:  # (gpt_nd.py's --dp is a word)
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value}: must be 1 or more", hint=f"e.g. {flag} 1",
                             same_on_every_rank=True)
    for name in OUTPUT_FLAGS:
        path = getattr(args, name, None)
        if path:
            check_output_path(path, "--" + name.replace("_", "-"))
    directory = getattr(args, "checkpoint_dir", None)
    if directory:  # a directory, made if absent: it or its parent must exist, writable
        check_output_path(os.path.join(directory, "latest") if os.path.isdir(directory)
                          else directory, "--checkpoint-dir")
    if getattr(args, "step_delay", 0) < 0:
        raise UsageError(f"--step-delay {args.step_delay:g}: must be 0 or more",
                         hint="e.g. --step-delay 0.5", same_on_every_rank=True)
    if getattr(args, "collectives", "torch") == "minddp":
        from ..collectives import chosen  # (torch loads here, once every flag has passed)
        chosen.use("minddp")  # naive.py and bucketed.py call chapter 0's ring from now on
    return args


def _can_write_in(directory):
    # Try it: os.access() says yes to root even where a write fails (/proc, read-only mounts).
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def check_output_path(path, flag):
    """The directory PATH would be written in must exist and be writable."""
    directory = os.path.dirname(os.path.abspath(path))
    hint = "choose a file in a directory you can write to"
    if os.path.isdir(path):
        problem = "is a directory, not a file name"
    elif not os.path.isdir(directory):
        problem = f"its directory {directory} does not exist"
        hint = f"mkdir -p {directory}, or {hint}"
    elif not _can_write_in(directory):
        problem = f"its directory {directory} is not writable"
    else:
        return
    raise UsageError(f"{flag} {path}: {problem}", hint=hint, same_on_every_rank=True)
