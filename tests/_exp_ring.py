import faulthandler, sys, pathlib
def go(rank, ws):
    from minddp.grader.checks import CHECKS
    from minddp.grader.student import load
    from minddp.grader.exercises import EXERCISES
    faulthandler.dump_traceback_later(8, file=open(f"/tmp/exp/stack{rank}.txt", "w"))
    st = load(pathlib.Path("/tmp/exp/st/ring_reduce_scatter.py"), EXERCISES["ring"].lesson)
    return CHECKS["ring"](st, rank, ws)
