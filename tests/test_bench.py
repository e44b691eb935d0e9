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
    lines = result.stdout.splitlines()
    columns = [len(c) for c in lines[2].split()]  # tabulate's dashes give each column's width
    starts = [sum(columns[:i]) + 2 * i for i in range(len(columns))]
    rows = [[line[a:a + w].strip() for a, w in zip(starts, columns)] for line in lines[3:]]
    by = {r[3]: dict(zip(["ms", "vs", "same", "mb", "calls", "memory"], r[4:])) for r in rows}
    assert list(by) == ["no sync", "naive", "bucketed", "stock", "bucketed view", "stock view",
                        "bucketed fp16", "stock fp16"]
    assert by["stock"]["vs"] == "1.00x" and by["stock view"]["same"] == "1.00x"
    # 0.27M float32 parameters: 1.0 MB all-reduced per step, 0.5 MB with the fp16 hook.
    assert [by[c]["mb"] for c in ("naive", "bucketed", "stock", "bucketed view")] == ["1.0"] * 4
    assert by["bucketed fp16"]["mb"] == by["stock fp16"]["mb"] == "0.5"
    assert by["naive"]["calls"] == "10" and by["bucketed"]["calls"] == "1"
    # .grad and buckets: 2 copies of the gradients, 1 with gradient_as_bucket_view.
    assert by["bucketed"]["memory"] == by["stock"]["memory"] == "2.0"
    assert by["bucketed view"]["memory"] == by["stock view"]["memory"] == "1.0"
