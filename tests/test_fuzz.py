"""The fuzzer (minddp/fuzz/): a bounded run finds no difference; each planted bug is found.

    pytest tests/test_fuzz.py

A run of drawn cases on meshes of up to 4 ranks, each beside one process in invariant mode:
every case taken is IDENTICAL, the refused ones counted as refused. Then each planted bug
(`minddp fuzz --plant NAME`) on meshes of 2 ranks, cases drawn until the first difference:
found, and how many cases it took is printed (docs/fuzz.md's table). The cases the fuzzer
found in minddp itself run again, IDENTICAL now. Ranks are started by the fuzzer (gloo).
"""

import re
import sys

import pytest

from ahead import ahead_run
from minddp.fuzz import planted
from minddp.fuzz.cases import Case, draw, refusal

# Cases the fuzzer drew that differed or raised, each since fixed: (seed, ranks, what it was)
FOUND = [(18, 4, "a padded vocabulary's table kept its old shape on a stage without it")]
FUZZ = [sys.executable, "-m", "minddp", "fuzz"]
BOUNDED = ahead_run([*FUZZ, "--ranks", "4", "--cases", "16", "--seed", "2"])
# The drawn case (from seed 0, meshes of 2 ranks) that first finds each planted bug:
# docs/fuzz.md's table. The draws and the bugs' effects are fixed, so these are too.
FOUND_BY = {"vocab-remainder": 9, "bias-every-rank": 9, "local-loss": 1, "sp-norm-unsummed": 9,
            "stage-residual": 48}
PLANTED = {name: ahead_run([*FUZZ, "--ranks", "2", "--cases", "64", "--first", "--plant",
                            name]) for name in planted.PLANTS}
REPLAYED = {seed: ahead_run([*FUZZ, "--case", str(seed), "--ranks", str(ranks)])
            for seed, ranks, _ in FOUND}


def _verdicts(run):
    """[(case seed, verdict)] of a fuzz run's lines, and its last line."""
    found = re.findall(r"^case (\d+): .*: (IDENTICAL|DIFFERENT|raised|refused)", run.stdout,
                       re.MULTILINE)
    return [(int(seed), verdict) for seed, verdict in found], run.stdout.strip().splitlines()[-1]


def test_a_bounded_run_finds_no_difference_and_counts_what_it_refused():
    run = BOUNDED.result()
    verdicts, summary = _verdicts(run)
    counted = [v for _, v in verdicts]
    assert run.returncode == 0 and summary.endswith(", 0 differences"), run.stdout + run.stderr
    assert summary.startswith("16 cases,") and len(verdicts) == 16, summary
    assert counted.count("IDENTICAL") >= 4 and counted.count("refused") >= 1, summary
    assert set(counted) <= {"IDENTICAL", "refused"}
    print(summary)


@pytest.mark.parametrize("name", planted.PLANTS)
def test_each_planted_bug_is_found(name):
    run = PLANTED[name].result()
    verdicts, summary = _verdicts(run)
    found = [i for i, (_, v) in enumerate(verdicts) if v in ("DIFFERENT", "raised")]
    assert run.returncode == 1 and found, f"{name}: {summary}\n{run.stderr[-2000:]}"
    seed = verdicts[found[0]][0]
    assert f"reproduce: minddp fuzz --case {seed} --ranks 2 --plant {name}" in run.stdout
    taken = sum(v != "refused" for _, v in verdicts[:found[0] + 1])
    print(f"{name}: found by drawn case {found[0] + 1} ({taken} run, the rest refused)")
    assert found[0] + 1 == FOUND_BY[name], (name, found[0] + 1)


@pytest.mark.parametrize("seed, ranks, what", FOUND)
def test_what_the_fuzzer_found_in_minddp_stays_fixed(seed, ranks, what):
    run = REPLAYED[seed].result()
    assert _verdicts(run)[0] == [(seed, "IDENTICAL")], run.stdout + run.stderr


def test_a_case_is_its_seed():
    assert draw(1234, 4) == draw(1234, 4)
    assert draw(1234, 4) != draw(1235, 4)
    assert all(1 < draw(seed, 2).world_size <= 2 for seed in range(50))


def test_a_shape_the_lessons_refuse_is_refused_in_their_words():
    case = Case(seed=0, vocab=30, d=8, heads=2, blocks=2, tokens=8, tied=False, dropout=0.0,
                clip=None, recompute="none", sequence_parallel=False, dp=1, tp=4, pp=1,
                dp_kind="fsdp", shards=8, chunks=4, batch=8)
    assert refusal(case).startswith("--mesh tp=4: tp=4 does not divide the 2 attention heads")
    case.tp, case.dp = 1, 3
    assert "dp=3 is not a power of two" in refusal(case)
    case.dp, case.pp, case.tied = 1, 2, True
    assert "a tied embedding cannot be split over pipeline stages" in refusal(case)
    case.tied, case.tokens, case.heads, case.d = False, 6, 4, 16
    assert "the tokens (6) do not split into 4" in refusal(case)
    case.tokens = 8
    assert refusal(case) is None


def test_time_alone_draws_until_it_is_spent():
    from minddp.fuzz.fuzz import parse
    assert parse([]).cases == 16
    assert parse(["--time", "120"]).cases > 10**6  # not stopped at the default 16 cases
    assert parse(["--time", "120", "--cases", "3"]).cases == 3
