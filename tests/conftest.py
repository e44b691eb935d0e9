"""Fixtures shared by test files: one run of a script serves every test that needs its result.

    pytest tests/test_examples.py tests/test_breakit.py
"""

import ast
import inspect
import signal

import pytest

import ahead
import helpers
from ahead import launches_in
from helpers import select_modules, start_shared_spawns, stop_shared_spawns, warm_torchrun
from minddp.run.cli import torch_too_old


def pytest_configure(config):
    """On a torch older than minddp supports: one line, exit 2, no test run."""
    refusal = torch_too_old()
    if refusal:
        pytest.exit(refusal.strip(), returncode=2)
    _SESSIONS_CTRL_C.append(signal.getsignal(signal.SIGINT))


def pytest_collection_modifyitems(config, items):
    """The shared spawns run the registered work of the selected tests' modules only, in the
    background from now on; the tests that read their results run last, when they are in.
    The launches the selected tests read (tests/ahead.py) run ahead of them, in two threads.
    So the tests that read neither run first: what they start in front (a grade, a Ctrl-C)
    then shares the cores with the background, not the end of the session with nothing."""
    select_modules({item.module.__name__ for item in items if item.module is not None})
    launches = _launches_ahead(items)  # in the files' order: a spawn's reader's too, early
    readers = [item for item in items if _reads_a_spawn(item)]
    reading = set(readers)
    waiting = [item for item in items if item not in reading and _reads_a_launch(item)]
    reading |= set(waiting)
    items[:] = [item for item in items if item not in reading] + waiting + readers
    modules = {item.module.__name__ for item in readers}
    world_sizes = sorted({world_size for world_size, work in helpers._SHARED.items()
                          for fn, _ in work.values() if fn.__module__ in modules},
                         key=lambda world_size: -len(helpers._work(world_size)))
    if world_sizes and not config.option.collectonly:
        config.stash[_SPAWNS] = start_shared_spawns(world_sizes)  # most functions first
    if launches and not config.option.collectonly:
        config.stash[_AHEAD] = ahead.start(launches)  # in two threads


def pytest_sessionfinish(session):
    if _AHEAD in session.config.stash:
        ahead.stop(session.config.stash[_AHEAD])
    ahead.remove_folders()  # (also those of launches a test ran itself, with no thread ahead)
    if _SPAWNS in session.config.stash:
        stop_shared_spawns(session.config.stash[_SPAWNS])


_SPAWNS, _AHEAD = pytest.StashKey(), pytest.StashKey()
_SESSIONS_CTRL_C = []  # SIGINT's handler when the session began
_USES = {}  # module name: {top-level function: the names its body uses}


def _reached(item):
    """The names the test, its module's fixtures and the module's functions these call
    use, read with ast: whether it reads a shared spawn, and which launches ahead."""
    module = item.module
    if module.__name__ not in _USES:
        tree = ast.parse(inspect.getsource(module))
        _USES[module.__name__] = {
            node.name: {name.id for name in ast.walk(node) if isinstance(name, ast.Name)}
            for node in tree.body if isinstance(node, ast.FunctionDef)}
    uses = _USES[module.__name__]
    reached = {getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ())}
    more = reached
    while more:
        more = set().union(*(uses.get(name, set()) for name in more)) - reached
        reached |= more
    return reached


def _reads_a_spawn(item):
    """Whether the test (or a fixture of its module) calls shared_results, directly or
    through another function of its module. Only the order depends on it."""
    return item.module is not None and "shared_results" in _reached(item)


def _reads_a_launch(item):
    """Whether the test (or a function or fixture of its module it reaches) reads a launch
    ahead. Only the order depends on it."""
    return item.module is not None and bool(set(launches_in(item.module)) & _reached(item))


def _launches_ahead(items):
    """The launches (tests/ahead.py) the selected tests read, in the order of the first test
    to read each."""
    order = []
    for item in items:
        if item.module is not None:
            reached = _reached(item)
            for name, launches in launches_in(item.module).items():
                if name in reached:
                    order += [launch for launch in launches if launch not in order]
    return order


@pytest.fixture(autouse=True)
def _ctrl_c_stays_the_sessions():
    """A minddp command run in this process (helpers.cli, a parser) takes Ctrl-C for itself,
    as its own process should (run/cli.py: one line, exit 130 at once). Left so after the
    test, a Ctrl-C would end the session without its cleanup: the launches ahead and the
    spawns still running, their folders kept. So each test starts and ends with the
    session's own (a module's fixture may have run a command just before)."""
    signal.signal(signal.SIGINT, _SESSIONS_CTRL_C[0])
    yield
    signal.signal(signal.SIGINT, _SESSIONS_CTRL_C[0])


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
