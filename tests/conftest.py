"""Fixtures shared by test files: one run of a script serves every test that needs its result.

    pytest tests/test_examples.py tests/test_breakit.py
"""

import pytest

from helpers import select_modules, warm_torchrun
from minddp.run.cli import torch_too_old


def pytest_configure(config):
    """On a torch older than minddp supports: one line, exit 2, no test run."""
    refusal = torch_too_old()
    if refusal:
        pytest.exit(refusal.strip(), returncode=2)


def pytest_collection_modifyitems(config, items):
    """The shared spawns run the registered work of the selected tests' modules only."""
    select_modules({item.module.__name__ for item in items if item.module is not None})


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
