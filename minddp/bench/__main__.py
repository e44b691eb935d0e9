"""`python -m minddp.bench`: the DDP benchmark (bench/ddp.py), as `minddp bench`."""

import runpy

runpy.run_module("minddp.bench.ddp", run_name="__main__", alter_sys=True)
