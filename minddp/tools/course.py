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

PARTS = [  # (the chapter's folder, or a heading; its files in the order to read them)
    ("Lesson 9 itself: devices, one device, DDP (stock's, then minddp's pieces)", [
        "examples/devices.py", "examples/single_device.py", "examples/stock_ddp.py",
        "examples/manual_ddp.py"]),
    ("launch", ["usage_error.py", "backends.py", "start.py", "rendezvous.py", "groups.py",
                "teardown.py"]),
    ("collectives", ["p2p.py", "work.py", "ops.py", "checks.py", "tree_and_chain.py",
                     "ring_all_gather.py", "ring_reduce_scatter.py", "ring_all_reduce.py",
                     "ring_reduce.py", "tree.py", "halving_doubling.py", "pairwise.py",
                     "dissemination.py", "cost.py", "chosen.py",
                     "examples/break_collectives.py"]),
    ("ddp", ["sampler.py", "broadcast.py", "grad_hooks.py", "naive.py", "bucket_layout.py",
             "bucketed.py"]),
    ("zero", ["optimizer.py", "state.py", "examples/zero1.py"]),
    ("fsdp", ["shard.py", "param.py", "examples/fsdp.py"]),
    ("tp", ["ops.py", "parallel.py", "sequence_parallel.py", "plan.py", "examples/tp.py"]),
    ("pp", ["stage.py", "schedules.py", "interleaved.py", "zero_bubble.py", "v_shaped.py",
            "examples/pipeline.py"]),
    ("elastic", ["resize.py", "examples/elastic.py"]),
    ("mesh", ["device_mesh.py", "plan.py", "compose.py", "clip.py", "examples/gpt_nd.py"]),
    ("memory", ["recompute.py"]),
    ("cp", ["blockwise.py", "ring.py", "ring_attention.py", "context_parallel.py",
            "examples/context.py"]),
    ("ep", ["experts.py", "parallel.py", "examples/experts.py"]),
    ("invariant", ["step.py", "tree.py", "shards.py", "chunks.py", "tokens.py", "vocab.py",
                   "clip.py", "experts.py", "plan.py"]),
    ("Features and failures, each a small diff of manual_ddp.py", [
        "examples/accumulate.py", "examples/restart.py", "examples/uneven.py",
        "examples/break_ddp.py", "examples/break_fsdp.py", "examples/break_tp.py",
        "examples/break_pp.py", "examples/break_context.py", "examples/break_experts.py",
        "examples/break_invariant.py"]),
]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def chapters(root=ROOT):
    """[(heading, [file paths from the repository's root])]: a chapter is headed by its
    folder and opens with its __init__.py, the chapter's first page."""
    found = []
    for part, files in PARTS:
        folder = root / "minddp" / part
        if not folder.is_dir():
            found.append((part, files))
            continue
        paths = [f if f.startswith("examples/") else f"minddp/{part}/{f}" for f in files]
        found.append((f"`minddp/{part}/`", [f"minddp/{part}/__init__.py", *paths]))
    return found


ORDER = [path for _, paths in chapters() for path in paths]
BEGIN = "<!-- the reading order: made by `minddp lessons` -->"
END = "<!-- end of the reading order -->"


def table(root=ROOT):
    """The reading order in markdown: a table per chapter (#, file, lines, idea), numbered
    through."""
    rows, number = [], 0
    for heading, paths in chapters(root):
        rows += ["", f"#### {heading}", "", "| # | file | lines | idea |",
                 "| --- | --- | --- | --- |"]
        for path in paths:
            number += 1
            text = (root / path).read_text()
            idea = ast.get_docstring(ast.parse(text)).splitlines()[0].rstrip(".")
            rows.append(f"| {number} | `{path}` | {len(text.splitlines())} | {idea} |")
    return "\n".join(rows[1:]) + "\n"


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
    lessons = [p for part, _ in PARTS if (root / "minddp" / part).is_dir()
               for p in (root / "minddp" / part).glob("*.py")]
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
