"""The `minddp` command: every tool of the project, one subcommand each.

    minddp --help
    minddp diff runs/manual.txt runs/stock.txt
    python -m minddp diff runs/manual.txt runs/stock.txt    # the same, without the entry point

Each subcommand runs its module as a script (its own --help, flags and exit status), so
`minddp timeline ...` and `python -m minddp.bench.timeline ...` are one program.
"""

import difflib
import gc
import importlib.metadata
import runpy
import sys

COMMANDS = {  # subcommand: (module, what it does)
    "lessons": ("minddp.tools.course", "the reading order: each file's size and idea"),
    "diff": ("minddp.tools.diff", "compare two gradient tables, element by element"),
    "exercise": ("minddp.grader.writer", "a lesson with its ideas taken out, for a student"),
    "grade": ("minddp.grader.grade", "a student's lesson file against stock, bit for bit"),
    "site": ("minddp.site.build", "the course as a web site: build, serve, screenshots"),
    "timeline": ("minddp.bench.timeline", "when backward computes and each all-reduce runs"),
    "bench": ("minddp.bench.ddp", "step time: naive, bucketed and stock DDP, as ratios"),
    "zero-bench": ("minddp.bench.zero", "ZeRO-1: optimizer state per rank, step time"),
    "fsdp-bench": ("minddp.bench.fsdp", "DDP, ZeRO-1/2/3 and stock fully_shard: bytes and time"),
    "tp-bench": ("minddp.bench.tp", "tensor parallel vs stock: bytes sent, memory, step time"),
    "pp-bench": ("minddp.bench.pp", "pipeline vs stock: the bubble per stage, activations"),
    "mesh-bench": ("minddp.bench.mesh", "every mesh of 4 and 8 ranks: held and sent per rank"),
    "invariant-bench": ("minddp.bench.invariant", "the invariant mode beside the normal one:"
                        " step time, memory per mesh"),
    "pp-schedules": ("minddp.tools.pipeline_slots", "every pipeline schedule laid out: bubble,"
                     " activations alive"),
    "elastic-bench": ("minddp.bench.elastic", "the ordered reduction vs all_reduce: bytes, time"),
    "memory": ("minddp.tools.memory", "what one rank holds: parameters, gradients, optimizer,"
               " activations"),
    "recompute-bench": ("minddp.bench.recompute", "activations kept per block by policy,"
                        " the recompute's cost"),
    "cp-bench": ("minddp.bench.context", "context parallel: work per rank, bytes round the"
                 " ring, activations"),
    "ep-bench": ("minddp.bench.experts", "expert parallel: tokens per expert, the all_to_alls'"
                 " bytes, held"),
    "collectives-bench": ("minddp.bench.collectives", "chapter 0's collectives beside gloo's:"
                          " time, bytes, the alpha-beta fit"),
}


def version(package):
    """An installed package's version, read without importing it (torch takes seconds)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def usage():
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: minddp COMMAND [flags]   (COMMAND --help: its flags; minddp --version)\n\n"
            "commands:\n" + "\n".join(lines) + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    if argv[0] == "--version":
        print(f"minddp {version('minddp')}, torch {version('torch')}")
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        print(f"---> HINT: {'did you mean ' + close[0] + '? ' if close else ''}"
              f"minddp --help lists the commands", file=sys.stderr)
        return 2
    sys.argv = [f"minddp {argv[0]}", *argv[1:]]
    runpy.run_module(COMMANDS[argv[0]][0], run_name="__main__", alter_sys=True)  # it exits itself
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        # torch's import made ~300k objects; the interpreter's exit would walk them all in its
        # last collections (0.6-0.8 s on a 2-core machine). Frozen, they are skipped; the
        # memory goes back with the process. (The command's own work is over here.)
        gc.freeze()
