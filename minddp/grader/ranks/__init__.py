"""The ranks a grade starts: one group per world size, under a time limit, and why they hang.

    minddp grade exercises/naive.py      # grade.py calls world.run_world once per world size

    world.py      one world size's ranks, forked warm: each loads the student's file and runs
                  the exercise's check; their results, or the rank that raised, or where
                  each one waits past the time limit, read back
    mismatch.py   why ranks hang in a collective: each one's group, src and sizes side by side
    pairing.py    do a student's sends and receives pair up, and complete? a dry run, before
                  a real one hangs
"""
