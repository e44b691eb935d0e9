"""Fixtures shared by test files: one run of a script serves every test that needs its result.

    pytest tests/test_examples.py tests/test_breakit.py
"""

import ast
import inspect

import pytest

import helpers
from helpers import select_modules, start_shared_spawns, stop_shared_spawns, warm_torchrun
from minddp.run.cli import torch_too_old


def pytest_configure(config):
    """On a torch older than minddp supports: one line, exit 2, no test run."""
    refusal = torch_too_old()
    if refusal:
        pytest.exit(refusal.strip(), returncode=2)


def pytest_collection_modifyitems(config, items):
    """The shared spawns run the registered work of the selected tests' modules only, in the
    background from now on; the tests that read their results run last, when they are in."""
    select_modules({item.module.__name__ for item in items if item.module is not None})
    readers = [item for item in items if _reads_a_spawn(item)]
    reading = set(readers)
    items[:] = [item for item in items if item not in reading] + readers
    modules = {item.module.__name__ for item in readers}
    world_sizes = sorted({world_size for world_size, work in helpers._SHARED.items()
                          for fn, _ in work.values() if fn.__module__ in modules},
                         key=lambda world_size: -len(helpers._work(world_size)))
    if world_sizes and not config.option.collectonly:
        config.stash[_SPAWNS] = start_shared_spawns(world_sizes)  # most functions first


def pytest_sessionfinish(session):
    if _SPAWNS in session.config.stash:
        stop_shared_spawns(session.config.stash[_SPAWNS])


_SPAWNS = pytest.StashKey()
_READERS = {}  # module name: its top-level functions that read a shared spawn's results


def _reads_a_spawn(item):
    """Whether the test (or a fixture of its module) calls shared_results, directly or
    through another function of its module: read with ast. Only the order depends on it."""
    module = item.module
    if module is None:
        return False
    if module.__name__ not in _READERS:
        tree = ast.parse(inspect.getsource(module))
        uses = {node.name: {name.id for name in ast.walk(node) if isinstance(name, ast.Name)}
                for node in tree.body if isinstance(node, ast.FunctionDef)}
        readers, more = {"shared_results"}, True
        while more:
            found = {name for name, used in uses.items() if used & readers} - readers
            readers, more = readers | found, bool(found)
        _READERS[module.__name__] = readers
    names = {getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ())}
    return bool(names & _READERS[module.__name__])


@pytest.fixture(scope="session")
def launch(tmp_path_factory):
    """launch(script, nproc, *args) -> (result, table path); each distinct run happens once.
    Its workers are torchrun's, forked warm (helpers.warm_torchrun): the tests that use it
    compare what a script computes; test_examples.py's timeline test runs the real torchrun
    beside it and finds the same table and the same lines."""
    cache, tmp = {}, tmp_path_factory.mktemp("runs")

    def _launch(script, nproc, *args):
        key = (script.name, nproc, args)
        if key not in cache:
            table = tmp / f"{script.stem}-{nproc}-{len(cache)}.txt"
            result = warm_torchrun(nproc, script, *args, "--grad-table", table)
            assert result.returncode == 0, result.stdout + result.stderr
            cache[key] = (result, table)
        return cache[key]
    return _launch
