"""The fuzzer: bugs that hide among rounding, found by drawing models and meshes in invariant mode.

    minddp fuzz --ranks 4 --cases 16            # 16 drawn cases, each mesh beside one process
    minddp fuzz --case 1234 --ranks 4           # one case again, from its seed
    pytest tests/test_fuzz.py                   # a bounded run, and each planted bug found

In invariant mode (minddp/invariant/) a mesh gives one process's bits, so a difference
between them is a bug, never rounding: testing every composition becomes an exact check, and
a program can search for the bugs people meet (a vocabulary the tensor-parallel size does
not divide, a stage count that does not divide the blocks). In the order to read:
    cases.py    one case from one seed: a model, a mesh, the flags; the lessons' refusals
    run.py      the cases of a world size on one group of ranks, their references on one
    planted.py  known bugs, planted one at a time, for the tests to prove they are found
    fuzz.py     `minddp fuzz`: draw, run, compare; N cases, M shapes, K refused, D differences
"""
