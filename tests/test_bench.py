"""The benchmark runs and reports what it promises (its figures are in docs/benchmark.md).

    pytest tests/test_bench.py

Not a timing test: speed is measured by `python -m minddp.bench`, not asserted here.
"""

import sys

from helpers import run


def test_bench_reports_every_contender_as_a_ratio_to_stock():
    result = run([sys.executable, "-m", "minddp.bench", "--sizes", "0.3M", "--world-sizes", "2",
                  "--rounds", "2", "--warmup", "1"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("2 ")]
    by_contender = {" ".join(r[3:-4]): r for r in rows}
    assert list(by_contender) == ["no sync", "naive", "bucketed", "stock"]
    assert by_contender["stock"][-3] == "1.00x"
    # 0.27M float32 parameters: 1.0 MB all-reduced per step by every synced contender.
    assert [by_contender[c][-2] for c in ("naive", "bucketed", "stock")] == ["1.0"] * 3
    assert by_contender["naive"][-1] == "10" and by_contender["bucketed"][-1] == "1"
