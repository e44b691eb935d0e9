"""The fork server's last preload (warm.py): everything imported so far, set aside from the
collector, so that each rank forked from the server collects only what it makes itself.

    pytest tests/test_warm.py       # a warm rank still frees its cycles and DTensor's caches

Importing this module has that effect, in whichever process imports it: only warm.py's
server does (multiprocessing.set_forkserver_preload imports each name it is given).
"""

from ..launch.teardown import freeze_imported

freeze_imported()
