"""Exercises: a lesson file with the bodies of its ideas taken out, for a student to write again.

    minddp exercise --list                  # the exercises, one line each
    minddp exercise naive exercises/        # writes exercises/naive.py
    minddp grade exercises/naive.py         # bit for bit against stock, or what is wrong

Each exercise names a lesson file and the functions (or methods) that carry its idea. The
starting file is the lesson itself, read now: every line kept but the bodies of those
functions, each replaced by its docstring, a TODO saying what it must do, and a `raise
NotImplementedError`. So an exercise never drifts from its lesson, and the lesson file,
graded as it is, passes (tests/test_grade.py).
"""

import argparse
import ast
import functools
import pathlib
import sys
import textwrap

from .exercises import EXERCISES

ROOT = pathlib.Path(__file__).resolve().parents[1]  # minddp/


def _functions(tree):
    """{"Class.method" or "function": its ast node} for the module's top level."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = item
    return found


def starting_file(name):
    """The exercise's starting file: its lesson with each TODO body taken out (text)."""
    def todo(qualname, what, indent):
        lines = textwrap.wrap(f"TODO ({qualname}): {what}.", 92 - len(indent))
        return [f"{indent}# {line}" for line in lines] + \
            [f'{indent}raise NotImplementedError("TODO: {qualname}")']
    return _header(name) + with_bodies(name, {q: functools.partial(todo, q, what)
                                               for q, what in EXERCISES[name].todo.items()})


def solution(name, bodies):
    """A student's file: the starting file with each TODO written, bodies[qualname] (text,
    as at the top level: indented here)."""
    def written(body, indent):
        return [indent + line if line.strip() else "" for line in
                textwrap.dedent(body).strip("\n").splitlines()]
    return _header(name) + with_bodies(name, {q: functools.partial(written, body)
                                               for q, body in bodies.items()})


def _header(name):
    return (f"# minddp exercise {name!r}: write each TODO below, then `minddp grade"
            f" {name}.py`.\n# The lesson it comes from: minddp/{EXERCISES[name].path}\n")


def with_bodies(name, makers):
    """The lesson's text with the body of each function in `makers` (qualname -> a function
    of the indent giving the new lines) replaced; its docstring kept."""
    source = (ROOT / EXERCISES[name].path).read_text()
    lines, functions = source.splitlines(), _functions(ast.parse(source))
    # From the bottom up, so that earlier line numbers stay right.
    for qualname, make in sorted(makers.items(), key=lambda kv: -functions[kv[0]].lineno):
        node = functions[qualname]
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str)
        if has_doc:
            start = first.end_lineno  # (0-based: the line after the docstring)
        else:  # the comments above the first statement go too: they tell how
            start = first.lineno - 1
            while start - 1 >= node.lineno and lines[start - 1].strip().startswith("#"):
                start -= 1
        lines[start:node.end_lineno] = make(" " * (node.col_offset + 4))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="minddp exercise", description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", choices=list(EXERCISES), help="the exercise")
    parser.add_argument("directory", nargs="?", default=".", help="where to write it")
    parser.add_argument("--list", action="store_true", help="the exercises, one line each")
    args = parser.parse_args(argv)
    if args.list or args.name is None:
        width = max(map(len, EXERCISES))
        for name, e in EXERCISES.items():
            print(f"{name:{width}} minddp/{e.path}: {', '.join(e.todo)}  (against {e.against})")
        return 0
    directory = pathlib.Path(args.directory)
    if directory.exists() and not directory.is_dir():
        print(f"error: {directory} is a file, not a directory\n---> HINT: another directory",
              file=sys.stderr)
        return 2
    directory.mkdir(parents=True, exist_ok=True)  # `minddp exercise naive exercises/`: made
    path = directory / f"{args.name}.py"  # the student's file: the exercise's name
    if path.exists():
        print(f"error: {path} exists: it would be overwritten\n---> HINT: another directory,"
              f" or move {path} away", file=sys.stderr)
        return 2
    path.write_text(starting_file(args.name))
    print(f"wrote {path}: {len(EXERCISES[args.name].todo)} TODO(s); then: minddp grade {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
