"""The docs tell the truth: sizes, help(), and every command they show.

    pytest tests/test_docs.py

- README's reading-order table states each file's size: it must be the file's size.
- help() of every public name opens with a sentence of its own; a collective says so.
- Every command in README.md, docs/*.md and the docstrings of minddp/ and examples/
  (`minddp SUB ...`, `python -m minddp SUB ...`, `python -m minddp.X ...`,
  `python examples/X.py ...`, `torchrun ... examples/X.py ...`)
  is parsed by the program it names: the program exists, each flag exists, each value is
  one of the flag's choices. A renamed flag cannot leave a dead command behind.
"""

import ast
import contextlib
import io
import re
import runpy
import shlex
import sys

import pytest

import minddp
from helpers import REPO
from minddp.__main__ import COMMANDS, main as minddp_main

SUBCOMMANDS = "|".join([*COMMANDS, "--help"])  # `minddp needs ...` in prose is no command

COLLECTIVES = {"NaiveDDP", "BucketedDDP", "ManualDDP", "broadcast_parameters", "check_same_model",
               "fully_shard", "ddp_setup", "ddp_teardown", "check_replicas", "save_checkpoint",
               "all_reduce_accuracy", "ShardedOptimizer", "ring_attention"}


def test_readme_sizes_are_the_files_sizes():
    readme = (REPO / "README.md").read_text()
    for path, lines in re.findall(r"`(minddp/[\w/]+\.py)` \((\d+)", readme):  # the folders
        assert len((REPO / path).read_text().splitlines()) == int(lines), path
    for doc in (REPO / "docs").glob("*.md"):  # "`minddp/pp/stage.py` (178 lines)" in a docs page
        for path, lines in re.findall(r"`((?:minddp|examples)/[\w/]+\.py)` \((\d+) lines",
                                      doc.read_text()):
            assert len((REPO / path).read_text().splitlines()) == int(lines), (doc.name, path)


def test_the_reading_order_is_made_from_the_files():
    # docs/course.md's table is what `minddp lessons` makes: every size and idea the files'.
    from minddp.tools.course import ORDER, in_doc, table
    assert in_doc((REPO / "docs" / "course.md").read_text()) == table()
    assert len(ORDER) == len(set(ORDER)), "the reading order names a file twice"
    from test_layout import CHAPTERS  # every file of every chapter, its first page too
    lessons = {p.relative_to(REPO).as_posix() for c in CHAPTERS
               for p in (REPO / "minddp" / c).glob("*.py")}
    assert lessons <= set(ORDER), f"lessons missing from the reading order: {lessons - set(ORDER)}"
    assert set(ORDER) - lessons <= {f"examples/{p.name}" for p in (REPO / "examples").glob("*.py")}


@pytest.mark.parametrize("name", minddp.__all__)
def test_help_opens_with_a_sentence_of_its_own(name):
    obj = getattr(minddp, name)
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    assert doc and doc.strip(), f"{name} has no docstring of its own"
    first = doc.strip().splitlines()[0]
    assert len(first) <= 100 and not first.startswith(name + "("), first
    if name in COLLECTIVES:
        assert "Collective: call on every rank." in doc, name


@pytest.mark.parametrize("name", [n for n in minddp.__all__ if isinstance(getattr(minddp, n), type)])
def test_help_shows_each_classs_own_init_and_forward(name):
    # help() falls back to a base's docstring (nn.Module's "Define the computation performed
    # at every call") when a method has none: every __init__ and forward minddp writes has its own.
    cls = getattr(minddp, name)
    for method in ("__init__", "forward"):
        owner = next((k for k in cls.__mro__ if method in k.__dict__), object)
        if owner.__module__.startswith("minddp") and not hasattr(cls, "__dataclass_fields__"):
            assert owner.__dict__[method].__doc__, f"{name}.{method} has no docstring of its own"


def _docstrings():
    for path in sorted(REPO.glob("minddp/**/*.py")) + sorted(REPO.glob("examples/*.py")):
        yield str(path.relative_to(REPO)), ast.get_docstring(ast.parse(path.read_text())) or ""


def _documents():
    yield "README.md", (REPO / "README.md").read_text()
    for path in sorted(REPO.glob("docs/*.md")):
        yield path.name, path.read_text()
    yield from _docstrings()


def commands():
    found = []
    for where, text in _documents():
        text = re.sub(r"\\\\?\n\s*", " ", text)  # join continued lines
        for line in text.splitlines():
            line = line.strip().lstrip("$> ").split("  #")[0].split(" # ")[0].strip()
            m = re.match(rf"(?:(?:python3? -m )?(minddp (?:{SUBCOMMANDS}))|python3? -m (minddp\.[\w.]+)"
                         r"|python3? (examples/\w+\.py)"
                         r"|torchrun (?:--[\w-]+(?:=\S+)? )*(examples/\w+\.py))(.*)$", line)
            if m:
                found.append((where, next(g for g in m.groups()[:4] if g), m.group(5)))
    return found


def _help_of(program, args):
    """Run `program args --help` in this process: (exit status, help text)."""
    out = io.StringIO()
    argv = [program] + args + ["--help"]
    old, sys.argv = sys.argv, argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if program == "minddp --help":
                assert minddp_main(["--help"]) == 0
            elif program.startswith("minddp "):
                sys.modules.pop(COMMANDS[program.split()[1]][0], None)
                minddp_main([program.split()[1]] + args + ["--help"])
            elif program.startswith("minddp."):
                sys.modules.pop(program, None)  # run it as __main__, not the imported copy
                runpy.run_module(program, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO / program), run_name="__main__")
        return 0, out.getvalue()
    except SystemExit as e:
        return e.code or 0, out.getvalue()
    finally:
        sys.argv = old


def test_the_docs_show_commands():
    programs = {program for _, program, _ in commands()}
    assert {"minddp diff", "minddp bench", "minddp timeline", "minddp fsdp-bench",
            "minddp zero-bench", "examples/manual_ddp.py", "examples/accumulate.py",
            "examples/restart.py"} <= programs


@pytest.mark.parametrize("where,program,args", commands(),
                         ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_every_command_in_the_docs_parses(where, program, args):
    if program.startswith("examples/"):
        assert (REPO / program).exists(), f"{where}: {program} does not exist"
    words = shlex.split(args)
    status, text = _help_of(program, words)
    assert status == 0, f"{where}: {program} {args}: {text[-800:]}"
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), \
            f"{where}: {program} has no flag {flag}"


def test_write_sizes_mends_a_size_that_drifted(tmp_path):
    # `minddp lessons --write-sizes` on a copy whose README quotes a wrong size and count
    from minddp.tools.course import write_sizes
    import shutil
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    for folder in ("minddp", "examples"):
        (tmp_path / folder).symlink_to(REPO / folder)
    readme = (REPO / "README.md").read_text()
    wrong = re.sub(r"`minddp/dropin/ddp.py` \(\d+", "`minddp/dropin/ddp.py` (1", readme)
    wrong = re.sub(r"\d+ files, \d+ lines in all", "1 files, 2 lines in all", wrong)
    assert wrong != readme
    (tmp_path / "README.md").write_text(wrong)
    course = tmp_path / "docs" / "course.md"  # and a reading-order row
    course.write_text(re.sub(r"(\| `minddp/launch/start.py` \| )\d+", r"\g<1>1", course.read_text()))
    assert course.read_text() != (REPO / "docs" / "course.md").read_text()
    write_sizes(tmp_path)
    assert (tmp_path / "README.md").read_text() == readme
    for doc in (REPO / "docs").glob("*.md"):
        assert (tmp_path / "docs" / doc.name).read_text() == doc.read_text(), doc.name
