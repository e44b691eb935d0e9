"""Gradient tables on disk and `minddp diff`: verdicts, tolerances, bad inputs.

    pytest tests/test_gradtable.py
"""

import numpy as np
import pytest
import torch

from minddp import GradTable
from minddp.tools.diff import main as diff_main, ulp_distance
from minddp.tools.tables import read_table, write_table


def _rows(world_size=2, steps=3, seed=0, names=("w", "b")):
    rng = np.random.default_rng(seed)
    shapes = {"w": (3, 2), "b": (3,), "v": (4,)}
    return [[(s, s // 2, {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in names})
             for s in range(steps)] for _ in range(world_size)]


def _table(tmp_path, name, rows):
    path = str(tmp_path / name)
    write_table(path, rows)
    return path


def _diff(capsys, *argv):
    code = diff_main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_round_trip_keeps_every_bit(tmp_path):
    rows = _rows()
    meta, grads = read_table(_table(tmp_path, "t.txt", rows))
    assert (meta["world_size"], meta["steps"], meta["names"]) == (2, 3, ["w", "b"])
    assert grads["w"].shape == (3, 2, 3, 2)  # [step, rank, *shape]
    assert grads["w"][2, 1].tobytes() == rows[1][2][2]["w"].tobytes()
    text = (tmp_path / "t.txt").read_text()
    assert "world size 2, 3 steps, 2 parameters" in text
    assert len([line for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]) == 12


def test_identical_tables_exit_0(tmp_path, capsys):
    a, b = _table(tmp_path, "a.txt", _rows()), _table(tmp_path, "b.txt", _rows())
    code, out, _ = _diff(capsys, a, b)
    assert code == 0 and "verdict: IDENTICAL" in out


def test_one_ulp_in_one_element_is_found_and_tolerances_pass_it(tmp_path, capsys):
    rows = _rows()
    a = _table(tmp_path, "a.txt", rows)
    w = rows[1][2][2]["w"]
    w[0, 1] = np.nextafter(w[0, 1], np.float32(np.inf))  # one ulp, step 2, rank 1
    b = _table(tmp_path, "b.txt", rows)
    code, out, _ = _diff(capsys, a, b)
    assert code == 1 and "verdict: DIFFERENT" in out
    assert "step 2 rank 1" in out and "summation order" in out
    code, out, _ = _diff(capsys, a, b, "--atol", "1e-6")
    assert code == 0 and "WITHIN TOLERANCE" in out
    code, _, _ = _diff(capsys, a, b, "--atol", "0", "--rtol", "1e-9")
    assert code == 1


def test_a_real_difference_is_not_called_rounding(tmp_path, capsys):
    rows = _rows()
    a = _table(tmp_path, "a.txt", rows)
    rows[0][0][2]["b"] *= 2  # what a missing division by world_size looks like
    code, out, _ = _diff(capsys, a, _table(tmp_path, "b.txt", rows))
    assert code == 1 and "more than rounding" in out and "step 0 rank 0" in out


def test_negative_zero_is_not_bitwise_equal_to_zero(tmp_path, capsys):
    rows = _rows()
    rows[0][0][2]["b"][0] = 0.0
    a = _table(tmp_path, "a.txt", rows)
    rows[0][0][2]["b"][0] = -0.0
    code, out, _ = _diff(capsys, a, _table(tmp_path, "b.txt", rows))
    assert code == 1  # values equal, bits not: "bitwise" means bits
    assert ulp_distance(np.float32([0.0]), np.float32([-0.0]))[0] == 0


@pytest.mark.parametrize("other, what", [
    (dict(steps=2), "steps differs"),
    (dict(names=("w", "v")), "other parameters (only in A: ['b'], only in B: ['v'])"),
])
def test_runs_that_cannot_be_compared_exit_2(tmp_path, capsys, other, what):
    a = _table(tmp_path, "a.txt", _rows())
    code, out, err = _diff(capsys, a, _table(tmp_path, "b.txt", _rows(**other)))
    assert code == 2 and what in err and out == ""
    assert len(err.splitlines()) == 2  # one line and a hint, no traceback


def _whole_rows(world_size, stages=1, steps=3, change=None):
    """Every rank the same whole gradients, as synced ones are; with stages, rank r holds
    only its stage's parameters (NaN for the rest), as a pipeline's table does."""
    rng = np.random.default_rng(0)
    grads = [{"w": rng.standard_normal((3, 2)).astype(np.float32),
              "b": rng.standard_normal(3).astype(np.float32)} for _ in range(steps)]
    if change is not None:
        change(grads)
    held = {"w": 0, "b": stages - 1}  # the stage that holds each parameter
    return [[(s, 0, {n: g if held[n] == r * stages // world_size else np.full_like(g, np.nan)
                     for n, g in grads[s].items()}) for s in range(steps)]
            for r in range(world_size)]


def test_tables_of_two_meshes_compare_whole_gradients(tmp_path, capsys):
    one = _table(tmp_path, "one.txt", _whole_rows(1))
    four = _table(tmp_path, "four.txt", _whole_rows(4, stages=2))  # two stages of two ranks
    code, out, _ = _diff(capsys, four, one)
    assert code == 0 and "verdict: IDENTICAL" in out and "world size 4" in out

    def one_ulp(grads):
        grads[1]["b"][2] = np.nextafter(grads[1]["b"][2], np.float32(np.inf))
    other = _table(tmp_path, "other.txt", _whole_rows(2, stages=2, change=one_ulp))
    code, out, _ = _diff(capsys, other, one)
    assert code == 1 and "verdict: DIFFERENT" in out
    assert "first difference: step 1, 'b', element [2]:" in out and "1 units in the last" in out
    code, out, _ = _diff(capsys, one, _table(tmp_path, "same.txt", _whole_rows(1)), "--whole")
    assert code == 0 and "whole gradients" in out


def test_a_table_whose_ranks_disagree_is_not_compared_whole(tmp_path, capsys):
    rows = _whole_rows(2)
    rows[1][0][2]["w"] = rows[1][0][2]["w"] * 2  # rank 1's own gradient: a skipped average
    code, _, err = _diff(capsys, _table(tmp_path, "a.txt", rows),
                         _table(tmp_path, "one.txt", _whole_rows(1)))
    assert code == 2 and "table A: at step 0, rank 1's 'w' is not rank 0's" in err


def test_unreadable_inputs_exit_2_with_one_line(tmp_path, capsys):
    good = _table(tmp_path, "good.txt", _rows())
    (tmp_path / "empty.txt.npz").write_bytes(b"")
    (tmp_path / "binary.txt.npz").write_bytes(bytes(range(256)) * 4)
    data = (tmp_path / "good.txt.npz").read_bytes()
    (tmp_path / "cut.txt.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "lonely.txt").write_text("a table without its element file\n")
    for bad, why in [("missing.txt", "no such file"), ("empty.txt", "not a minddp gradient table"),
                     ("binary.txt", "not a minddp gradient table"), ("cut.txt", "not a minddp gradient table"),
                     ("lonely.txt", "element file")]:
        code, _, err = _diff(capsys, good, tmp_path / bad)
        assert code == 2, bad
        assert why in err and "Traceback" not in err and len(err.splitlines()) == 2, err
        assert "pickle" not in err, err  # numpy's advice about pickles does not apply here


def test_gradtable_records_names_of_the_unwrapped_module(tmp_path):
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    table = GradTable(Wrapper(model), str(tmp_path / "g.txt"))
    model(torch.ones(1, 2)).sum().backward()
    table.record(epoch=0)
    table.save()  # no process group: a world of one
    meta, grads = read_table(str(tmp_path / "g.txt"))
    assert meta["names"] == ["0.weight", "1.weight", "1.bias"]  # frozen bias left out
    assert np.array_equal(grads["1.weight"][0, 0], model[1].weight.grad.numpy())
    GradTable(model).record()  # without a path it records nothing and needs nothing
