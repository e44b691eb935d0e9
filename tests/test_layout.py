"""The folder is the course, in chapters: each lesson-sized, no import back, no circle.

    pytest tests/test_layout.py

- `ls minddp/` shows __init__.py/__main__.py, the chapters (folders of lessons, in the reading
  order) and eight folders besides; no lesson file sits at the top.
- Every folder opens with a docstring that names every file in it; a chapter's also says how
  to run it. Every lesson file is at most 180 lines and breathes (no semicolons).
- The layering, read from the source (ast, every import, those inside functions too): a lesson
  imports only lessons of its own chapter or of chapters before it, never the drop-in, the
  references, the grader, the instruments, the benchmarks or the run support.
- No import circle among minddp's modules (the same scan), and no folder's __init__ gives a
  name that hides one of its files (`minddp.fsdp.shard` is the file, never a function).
- The front door (`minddp/__init__.py`) is a table of public names, each listed once; no
  lesson imports it, and it installs no import hook. Every public name resolves to the
  module that defines it; `minddp.tp` and `minddp.pp` give stock's names as stock's modules do.
"""

import ast
import subprocess
import sys
import tokenize

import pytest

import minddp
from helpers import REPO

PACKAGE = REPO / "minddp"
# The chapters, in the reading order (minddp lessons): a lesson imports only from its own
# chapter and the ones before it.
CHAPTERS = ["launch", "collectives", "ddp", "zero", "fsdp", "tp", "pp", "elastic", "mesh",
            "memory", "cp", "ep", "invariant"]
SUPPORT = ["dropin", "references", "grader", "tools", "bench", "run",  # above every chapter
           "site", "fuzz"]
# Rooms inside a folder (the grader's): each opens with its own page, as a folder does.
ROOMS = sorted(p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("*/*/__init__.py"))
LESSONS = sorted(f"{c}/{p.stem}" for c in CHAPTERS for p in (PACKAGE / c).glob("*.py")
                 if not p.name.startswith("__"))


def test_the_top_level_is_the_chapters_and_eight_folders():
    files = sorted(p.name for p in PACKAGE.glob("*.py"))
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files == ["__init__.py", "__main__.py"]
    assert folders == set(CHAPTERS) | set(SUPPORT)


@pytest.mark.parametrize("folder", CHAPTERS + SUPPORT + ROOMS)
def test_each_folder_opens_with_a_page_naming_every_file(folder):
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
    assert doc and len(doc.splitlines()) >= 3, folder
    for path in (PACKAGE / folder).glob("*.py"):
        if not path.name.startswith("__"):
            assert path.name in doc, f"{folder}/__init__.py does not name {path.name}"
    for room in (PACKAGE / folder).glob("*/__init__.py"):
        name = f"{room.parent.name}/"
        assert name in doc, f"{folder}/__init__.py does not name {name}"
    if folder in CHAPTERS:  # the command that runs or proves it, first
        assert "pytest tests/" in doc or "torchrun" in doc, folder


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_is_lesson_sized(lesson):
    assert len((PACKAGE / f"{lesson}.py").read_text().splitlines()) <= 180


def _minddp_imports(path, root=REPO):
    """(module imported, names) for every import of minddp's own code in the file (any depth)."""
    package = path.relative_to(root).with_suffix("").parts[:-1]  # ("minddp", "x")
    if path.name == "__init__.py":
        package = path.relative_to(root).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module == "minddp" or module.startswith("minddp."):
                yield module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("minddp"):
                    yield alias.name, []


def _modules_imported(path, root=REPO):
    """The minddp modules a file imports: `from pkg import file` is the file, not pkg."""
    for module, names in _minddp_imports(path, root):
        folder = root.joinpath(*module.split("."))
        files = [n for n in names if (folder / f"{n}.py").exists() or (folder / n).is_dir()]
        yield from ([f"{module}.{n}" for n in files] or [module])


def _module_of(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_imports_only_its_chapter_and_those_before(lesson):
    chapter = lesson.split("/")[0]
    allowed = CHAPTERS[:CHAPTERS.index(chapter) + 1]
    for module in _modules_imported(PACKAGE / f"{lesson}.py"):
        assert module != "minddp", f"{lesson}.py imports the front door"
        assert module.split(".")[1] in allowed, f"{lesson}.py imports {module}"


def test_the_layering_test_catches_an_arrow_back_and_a_front_door(tmp_path):
    bad = tmp_path / "minddp" / "ddp" / "naive.py"
    bad.parent.mkdir(parents=True)
    (bad.parent / "bucketed.py").write_text("")
    bad.write_text("from ..dropin.checks import check_stock_arguments\n"
                   "from . import bucketed\nfrom .. import NaiveDDP\n"
                   "def f():\n    from ..tools import gradtable\n")
    found = list(_modules_imported(bad, root=tmp_path))
    assert found == ["minddp.dropin.checks", "minddp.ddp.bucketed", "minddp", "minddp.tools"]


def _graph():
    """{module: the minddp modules it imports}, for every file of the package."""
    return {_module_of(p): set(_modules_imported(p)) for p in PACKAGE.rglob("*.py")}


def _circle(graph):
    """One import circle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None
    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_circle_anywhere():
    assert _circle(_graph()) is None, " -> ".join(_circle(_graph()))


def test_the_circle_test_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("folder", CHAPTERS + SUPPORT + ROOMS)
def test_no_folder_gives_a_name_that_hides_one_of_its_files(folder):
    tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
    # (`from . import file` gives the file itself: that hides nothing)
    given = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             and not (n.level == 1 and n.module is None) for a in n.names}
    files = {p.stem for p in (PACKAGE / folder).glob("*.py")}
    assert not given & files, f"minddp.{folder}'s {sorted(given & files)} hide its files"


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_breathes(lesson):
    # A lesson near its size is a sign to move code out, never to compress it: no statements
    # packed with semicolons, and lines past 95 columns a rare exception.
    path = PACKAGE / f"{lesson}.py"
    with path.open() as f:
        semicolons = [t.start[0] for t in tokenize.generate_tokens(f.readline)
                      if t.type == tokenize.OP and t.string == ";"]
    assert not semicolons, f"{lesson}.py: a semicolon on line {semicolons[0]}"
    wide = [n for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 95]
    assert len(wide) <= 5, f"{lesson}.py: {len(wide)} lines past 95 columns ({wide})"
    too_wide = [n for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert not too_wide, f"{lesson}.py: lines past 100 columns ({too_wide})"


def test_no_file_of_the_grader_is_past_300_lines():
    # Past that, a file is split by what its parts do (a check's run, its verdict, its
    # diagnoses), never compressed.
    long = {p.relative_to(PACKAGE).as_posix(): n for p in (PACKAGE / "grader").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


def test_each_exercise_has_a_checks_file_named_after_it():
    from minddp.grader.checks import CHECKS
    from minddp.grader.exercises import EXERCISES
    assert list(CHECKS) == list(EXERCISES)
    for name, check in CHECKS.items():
        assert check.__module__ == f"minddp.grader.checks.{name}", name


def test_no_line_of_the_package_or_the_examples_passes_100_columns():
    wide = [f"{path.relative_to(REPO)}:{n}" for path in [*PACKAGE.rglob("*.py"),
                                                          *(REPO / "examples").glob("*.py")]
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert not wide, f"lines past 100 columns: {wide}"


def test_the_fsdp_lesson_holds_no_drop_in_part():
    source = (PACKAGE / "fsdp" / "shard.py").read_text()
    for part in ("MixedPrecisionPolicy", "param_dtype", "reduce_dtype", "_fsdp_replaced_by",
                 "register_optimizer_step_pre_hook", "check_same_model"):
        assert part not in source, part


def test_no_instrument_imports_a_benchmark_or_the_grader():
    for path in (PACKAGE / "tools").glob("*.py"):
        for module in _modules_imported(path):
            assert not module.startswith(("minddp.bench", "minddp.grader")), path.name


def test_stock_private_fsdp_internals_are_read_in_one_place():
    readers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if "_fsdp_param_group" in p.read_text() or "_unsharded_param" in p.read_text()]
    assert readers == ["bench/stock_fsdp.py"]


@pytest.mark.parametrize("name", minddp.__all__)
def test_every_public_name_resolves_to_its_definition(name):
    assert getattr(getattr(minddp, name), "__module__", None) == f"minddp.{minddp.PUBLIC[name]}"


def test_tp_and_pp_give_stock_s_names_as_stock_s_modules_do():
    import torch.distributed.pipelining as stock_pp
    import torch.distributed.tensor.parallel as stock_tp

    import minddp.pp
    import minddp.tp
    assert {"ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
            "parallelize_module"} <= set(minddp.tp.__all__) & set(dir(stock_tp))
    assert {"PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
            "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
            "ScheduleDualPipeV"} <= set(minddp.pp.__all__) & set(dir(stock_pp))
    assert minddp.tp.ColwiseParallel is minddp.tp.parallel.ColwiseParallel
    assert minddp.pp.Schedule1F1B is minddp.pp.schedules.Schedule1F1B


def test_the_front_door_is_a_table_and_installs_no_hook():
    source = (PACKAGE / "__init__.py").read_text()
    assert "meta_path" not in source and "TYPE_CHECKING" not in source
    for name in minddp.PUBLIC:  # each public name once: its entry in the table
        assert source.count(f'"{name}"') == 1, name


def test_importing_minddp_loads_no_torch():
    # (the grader's own process too: it reads the student's file while its ranks' fork
    # server imports torch, so that a grade pays for one import, not two in a row)
    code = ("import sys, minddp, minddp.tools.diff, minddp.mesh.plan, minddp.grader.grade,"
            " minddp.grader.ranks.world; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_readme_is_an_entry_point():
    # What it is, set up, run, test, the reading order; the rest lives in docs/.
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_the_naive_lesson_fits_one_screen():
    assert len((PACKAGE / "ddp" / "naive.py").read_text().splitlines()) <= 110  # README
