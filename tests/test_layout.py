"""The folder is the course: lessons at the top, each lesson-sized, no import back from a lesson.

    pytest tests/test_layout.py

- `ls minddp/` shows the lessons, __init__.py/__main__.py, the chapter folders of lessons
  (collectives/: chapter 0) and four folders besides.
- Every lesson file is at most 180 lines, docstring included, a chapter's too.
- The layering, read from the source (ast): a lesson imports only other lessons (a chapter's:
  its own chapter's and the top level's) and the package's one error type (`from . import
  UsageError`), never the drop-in, the instruments, the benchmarks or the run support; and
  the FSDP lesson carries none of the drop-in's parts.
- The front door (`minddp/__init__.py`) is a table of public names, each listed once; no
  lesson imports it, and it installs no import hook.
- Every public name resolves to the module that defines it.
"""

import ast
import subprocess
import sys
import tokenize

import pytest

import minddp
from helpers import REPO

PACKAGE = REPO / "minddp"
LESSONS = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.name.startswith("__"))
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
CHAPTERS = ["collectives"]  # folders of lessons: chapter 0
CHAPTER_LESSONS = sorted(f"{c}/{p.stem}" for c in CHAPTERS for p in (PACKAGE / c).glob("*.py")
                         if not p.name.startswith("__"))


def test_the_top_level_is_the_lessons():
    assert set(LESSONS) == {"usage_error", "launch", "backends", "groups", "grad_hooks",
                            "sampler", "broadcast", "naive", "bucket_layout", "bucketed",
                            "zero", "zero_state", "fsdp", "fsdp_param", "tp_ops", "tp",
                            "tp_plan", "sp", "pp", "elastic", "teardown", "mesh", "rendezvous", "pp_schedules",
                            "mesh_plan", "compose", "clip", "pp_interleaved",
                            "pp_zero_bubble", "pp_v", "recompute", "blockwise", "context",
                            "context_parallel", "ring", "experts", "ep"}
    assert FOLDERS == ["bench", "collectives", "dropin", "run", "tools"]
    for folder in FOLDERS:  # each opens with a paragraph saying what it holds and for whom
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 3, folder


@pytest.mark.parametrize("lesson", LESSONS + CHAPTER_LESSONS)
def test_a_lesson_is_lesson_sized(lesson):
    assert len((PACKAGE / f"{lesson}.py").read_text().splitlines()) <= 180


def _minddp_imports(path, root=REPO):
    """(module imported, names) for every import of minddp's own code in the file (any depth)."""
    package = path.relative_to(root).with_suffix("").parts[:-1]  # ("minddp",) or ("minddp", "x")
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


@pytest.mark.parametrize("lesson", LESSONS + CHAPTER_LESSONS)
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


@pytest.mark.parametrize("lesson", LESSONS + CHAPTER_LESSONS)
def test_a_lesson_imports_only_lessons_never_the_front_door(lesson):
    for module, names in _minddp_imports(PACKAGE / f"{lesson}.py"):
        assert module != "minddp" or set(names) <= set(LESSONS), (lesson, names)  # a lesson
        if module != "minddp":  # a top-level lesson, or a chapter (a chapter: its own)
            assert module.split(".")[1] in LESSONS + CHAPTERS, f"{lesson}.py imports {module}"
            if "/" in lesson and module.split(".")[1] in CHAPTERS:
                assert module.split(".")[1] == lesson.split("/")[0], (lesson, module)
        assert not (module == "minddp" and set(names) & set(minddp.PUBLIC) - set(LESSONS)), \
            f"{lesson}.py imports {names} from the front door"


def test_the_layering_test_catches_an_arrow_back(tmp_path):
    bad = tmp_path / "minddp" / "naive.py"
    bad.parent.mkdir()
    bad.write_text("from .dropin.checks import check_stock_arguments\n"
                   "def f():\n    from .tools import gradtable\n")
    found = list(_minddp_imports(bad, root=tmp_path))
    assert ("minddp.dropin.checks", ["check_stock_arguments"]) in found
    assert ("minddp.tools", ["gradtable"]) in found


def test_the_fsdp_lesson_holds_no_drop_in_part():
    source = (PACKAGE / "fsdp.py").read_text()
    for part in ("MixedPrecisionPolicy", "param_dtype", "reduce_dtype", "_fsdp_replaced_by",
                 "register_optimizer_step_pre_hook", "check_same_model"):
        assert part not in source, part


def test_no_instrument_imports_a_benchmark():
    for path in (PACKAGE / "tools").glob("*.py"):
        assert not any(m.startswith("minddp.bench") for m, _ in _minddp_imports(path)), path.name


def test_stock_private_fsdp_internals_are_read_in_one_place():
    readers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if "_fsdp_param_group" in p.read_text() or "_unsharded_param" in p.read_text()]
    assert readers == ["bench/stock_fsdp.py"]


@pytest.mark.parametrize("name", minddp.__all__)
def test_every_public_name_resolves_to_its_definition(name):
    assert getattr(getattr(minddp, name), "__module__", None) == f"minddp.{minddp.PUBLIC[name]}"


def test_the_front_door_is_a_table_and_installs_no_hook():
    source = (PACKAGE / "__init__.py").read_text()
    assert "meta_path" not in source and "TYPE_CHECKING" not in source
    for name in minddp.PUBLIC:  # each public name once: its entry in the table
        assert source.count(f'"{name}"') == 1, name


def test_importing_minddp_loads_no_torch():
    code = "import sys, minddp, minddp.tools.diff; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_readme_is_an_entry_point():
    # What it is, set up, run, test, the reading order; the rest lives in docs/.
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_the_naive_lesson_fits_one_screen():
    assert len((PACKAGE / "naive.py").read_text().splitlines()) <= 110  # README: one screen
