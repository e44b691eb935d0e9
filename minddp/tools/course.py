"""The reading order: the course's files in the order to read them, with each one's size and idea.

    minddp lessons                            # the table, in markdown
    minddp lessons --check docs/course.md     # exit 1 if the doc's table is not the files'
    minddp lessons --write docs/course.md     # put the files' table between the doc's markers
    minddp lessons --write-sizes              # the sizes README.md and docs/ quote, made again

Only the order is written here. A row's idea is its file's own first docstring line and its
size the file's line count, so the table cannot drift from the code, and a new lesson adds
one name below, not a paragraph to the README.
"""

import argparse
import ast
import pathlib
import re
import sys

ORDER = [
    # lesson 9 itself: devices, one device, DDP (stock's, then minddp's pieces)
    "examples/devices.py", "examples/single_device.py", "examples/stock_ddp.py",
    "examples/manual_ddp.py",
    # data parallelism by hand
    "minddp/usage_error.py", "minddp/backends.py", "minddp/launch.py", "minddp/rendezvous.py",
    "minddp/groups.py",
    # chapter 0: the collectives by hand, from send and recv alone
    "minddp/collectives/__init__.py", "minddp/collectives/p2p.py", "minddp/collectives/work.py",
    "minddp/collectives/ops.py", "minddp/collectives/checks.py",
    "minddp/collectives/tree_and_chain.py", "minddp/collectives/ring_all_gather.py",
    "minddp/collectives/ring_reduce_scatter.py", "minddp/collectives/ring_all_reduce.py",
    "minddp/collectives/ring_reduce.py", "minddp/collectives/tree.py",
    "minddp/collectives/halving_doubling.py", "minddp/collectives/pairwise.py",
    "minddp/collectives/dissemination.py", "minddp/collectives/cost.py",
    "minddp/collectives/chosen.py", "examples/break_collectives.py",
    "minddp/sampler.py",
    "minddp/broadcast.py", "minddp/grad_hooks.py", "minddp/naive.py", "minddp/bucket_layout.py",
    "minddp/bucketed.py", "minddp/teardown.py",
    # sharding: ZeRO-1, then FSDP
    "minddp/zero.py", "minddp/zero_state.py", "examples/zero1.py", "minddp/fsdp.py",
    "minddp/fsdp_param.py", "examples/fsdp.py",
    # tensor and sequence parallelism
    "minddp/tp_ops.py", "minddp/tp.py", "minddp/sp.py", "minddp/tp_plan.py", "examples/tp.py",
    # pipeline parallelism, elastic training
    "minddp/pp.py", "minddp/pp_schedules.py", "minddp/pp_interleaved.py",
    "minddp/pp_zero_bubble.py", "minddp/pp_v.py",
    "examples/pipeline.py",
    "minddp/elastic.py", "examples/elastic.py",
    # composing them: every parallelism on one grid of ranks
    "minddp/mesh.py", "minddp/mesh_plan.py", "minddp/compose.py", "minddp/clip.py",
    "examples/gpt_nd.py",
    # memory: activations recomputed in backward
    "minddp/recompute.py",
    # context parallelism: the sequence cut over the ranks, attention round a ring
    "minddp/blockwise.py", "minddp/ring.py", "minddp/context.py", "minddp/context_parallel.py",
    "examples/context.py",
    # expert parallelism: experts on different ranks, tokens there and back by all_to_all
    "minddp/experts.py", "minddp/ep.py", "examples/experts.py",
    # features and failures, each a small diff of manual_ddp.py
    "examples/accumulate.py", "examples/restart.py", "examples/uneven.py",
    "examples/break_ddp.py", "examples/break_fsdp.py", "examples/break_tp.py",
    "examples/break_pp.py", "examples/break_context.py", "examples/break_experts.py",
]
ROOT = pathlib.Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- the reading order: made by `minddp lessons` -->", "<!-- end of the reading order -->"


def table(root=ROOT):
    """The reading order as a markdown table: #, file, lines, idea."""
    rows = ["| # | file | lines | idea |", "| --- | --- | --- | --- |"]
    for number, path in enumerate(ORDER, 1):
        text = (root / path).read_text()
        idea = ast.get_docstring(ast.parse(text)).splitlines()[0].rstrip(".")
        rows.append(f"| {number} | `{path}` | {len(text.splitlines())} | {idea} |")
    return "\n".join(rows) + "\n"


def in_doc(text):
    """The table between the markers of a doc, or None."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_sizes(root=ROOT):
    """Rewrite every "`path` (N" size in README.md and docs/*.md, the README's count of the
    lessons and the reading-order tables, from the files as they are (tests/test_docs.py)."""
    def size(match):
        lines = len((root / match.group(1)).read_text().splitlines())
        return f"`{match.group(1)}` ({lines}"
    lessons = [p for p in (root / "minddp").glob("*.py") if not p.name.startswith("__")]
    count = (f"{len(lessons)} files, "
             f"{sum(len(p.read_text().splitlines()) for p in lessons)} lines in all")
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        # "(N lines" or "(N)"; never "(9.1)", a section of the lesson named after a file
        text = re.sub(r"`((?:minddp|examples)/[\w/]+\.py)` \((\d+)(?=[ )])", size,
                      doc.read_text())
        if doc.name == "README.md":
            text = re.sub(r"\d+ files, \d+ lines in all", count, text)
        if in_doc(text) is not None:  # a reading-order table: made again from the files
            before, rest = text.split(BEGIN, 1)
            text = before + BEGIN + "\n" + table(root) + END + rest.split(END, 1)[1]
        doc.write_text(text)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="minddp lessons", description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="DOC", help="compare DOC's table with the files")
    parser.add_argument("--write", metavar="DOC", help="write the table between DOC's markers")
    parser.add_argument("--write-sizes", action="store_true",
                        help="rewrite the file sizes quoted in README.md and docs/")
    args = parser.parse_args(argv)
    if args.write_sizes:
        write_sizes()
        return 0
    if args.write:
        doc = pathlib.Path(args.write)
        text = doc.read_text()
        if in_doc(text) is None:
            print(f"error: {args.write} has no reading-order markers\n---> HINT: add the two"
                  f" lines {BEGIN} and {END}", file=sys.stderr)
            return 2
        before, rest = text.split(BEGIN, 1)
        doc.write_text(before + BEGIN + "\n" + table() + END + rest.split(END, 1)[1])
        return 0
    if args.check is None:
        print(table(), end="")
        return 0
    if in_doc(pathlib.Path(args.check).read_text()) != table():
        print(f"error: {args.check}'s reading order is not the files' (sizes or first lines)\n"
              f"---> HINT: minddp lessons --write {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
