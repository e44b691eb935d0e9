"""The grader: exercises made from the lessons, and a student's file graded beside stock.

For students and teachers of the course. `minddp exercise NAME DIR` writes a lesson with the
bodies of its ideas taken out; `minddp grade FILE` runs the student's file and stock PyTorch
on the same models and data, on real gloo ranks, and says passed (stock's bits), correct
(within a stated rounding bound of the exact result) or failed, with the mistake named.
The commands and the exercises first, then the rooms, each opening with its own page:
    exercises.py  the exercises: a lesson, the functions to write, a TODO for each
    writer.py     `minddp exercise`: the lesson with each TODO's body taken out, written
    grade.py      `minddp grade`: one file or a folder of them, the report, the exit status
    student.py    the student's file: which exercise, loaded as the lesson, its signatures
    ranks/        the ranks a grade starts, under a time limit, and why ranks hang
    checks/       one check per exercise, named after it; CHECKS, every check by name
    shared/       what several checks share: the models, a training run recorded, DDP's
                  run beside stock's, the pipeline's lists
    judge/        what a difference means: the mistake named, or the rounding bound a
                  right result that is not stock's bits lies in
docs/grade.md shows each exercise and what the grader says.
"""
