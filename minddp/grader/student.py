"""The student's file: which exercise it answers, loaded as the lesson it replaces, checked.

    minddp grade exercises/naive.py      # grade.py asks exercise_of; each rank calls load

A student's file is loaded as a module of the lesson's own package (minddp.ddp._graded_naive),
so that its relative imports reach minddp's other lessons as the lesson's do.
"""

import ast

from ..launch.usage_error import UsageError
from .exercises import EXERCISES


def exercise_of(path, name=None):
    """The exercise a file answers: `name`, or the one whose names it defines (one line else)."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file", hint="the path of the student's .py file")
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError as error:
        raise UsageError(f"{path} line {error.lineno}: {error.msg}",
                         hint="python -m py_compile " + str(path)) from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    if name is None:
        fits = [e for e, spec in EXERCISES.items() if set(spec.names) <= defined]
        if len(fits) != 1:
            raise UsageError(f"{path} answers {'none' if not fits else ' and '.join(fits)} of"
                             f" the exercises (by the names it defines)",
                             hint="--exercise NAME; minddp exercise --list names them")
        name = fits[0]
    missing = [n for n in EXERCISES[name].names if n not in defined]
    if missing:
        raise UsageError(f"{path} defines no {missing[0]}: exercise {name!r} asks for"
                         f" {', '.join(EXERCISES[name].names)}",
                         hint=f"start from `minddp exercise {name}`")
    return name


def load(path, lesson):
    """The student's file as a module of the minddp package (its `from .x import` works):
    minddp._graded_naive; a chapter's lesson in the chapter's package,
    minddp.collectives._graded_ring_reduce_scatter."""
    import importlib.util
    package, _, module = f"minddp.{lesson}".rpartition(".")
    spec = importlib.util.spec_from_file_location(f"{package}._graded_{module}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_signatures(student, lesson):
    """One line for a required name whose parameters are not the lesson's."""
    import inspect
    for qualname in EXERCISES[lesson].todo:
        owner, _, method = qualname.partition(".")
        ours = getattr(student, owner)
        theirs = getattr(load_lesson(lesson), owner)
        if method:
            ours, theirs = getattr(ours, method, None), getattr(theirs, method)
        if ours is None:
            raise UsageError(f"{owner} has no method {method}", hint=f"the lesson's: {qualname}"
                             f"{inspect.signature(theirs)}")
        wanted, got = inspect.signature(theirs), inspect.signature(ours)
        if list(wanted.parameters) != list(got.parameters):
            raise UsageError(f"{qualname}{got} does not take the lesson's arguments",
                             hint=f"{qualname}{wanted}")


def load_lesson(name):
    import importlib
    return importlib.import_module(f"minddp.{EXERCISES[name].lesson}")
