"""The grader: exercises made from the lessons, and a student's file graded beside stock.

For students and teachers of the course. `minddp exercise NAME DIR` writes a lesson with the
bodies of its ideas taken out; `minddp grade FILE` runs the student's file and stock PyTorch
on the same models and data, on real gloo ranks, and says passed (stock's bits), correct
(within a stated rounding bound of the exact result) or failed, with the mistake named:
    exercises.py  the exercises: a lesson, the functions to write, a TODO for each
    grade.py      `minddp grade`: one file or a folder of them, the report, the exit status
    student.py    the student's file: which exercise, loaded as the lesson, its signatures
    ranks.py      the ranks a grade starts, one group per world size, under a time limit
    mismatch.py   why ranks hang in a collective: each one's group, src and sizes side by side
    checks.py     every exercise's check, by name
    training.py   what the checks share: the models, the batches, one training run recorded
    ddp.py        the data-parallel checks: the average, no_sync, subgroups, buckets
    sharded.py    ZeRO-1 and FSDP: every shard and weight, step by step
    pieces.py     the sampler, the broadcast, 1F1B's list, the ring
    pairing.py    do a student's sends and receives pair up? a dry run, before a real one hangs
    schedules.py  the pipeline's lists past 1F1B: interleaved 1F1B, zero bubble's waits
    tp.py         the tensor-parallel check
    lessons.py    the device mesh's grid against stock's; recomputation against torch's checkpoint
    experts.py    expert parallelism against one process on the whole batch: splits, rows, sync
    clip.py       gradient clipping on a mesh against torchtitan's clip on stock's calls
    context.py    ring attention: its chunks, its parts of each block, the ring against stock's
    bound.py      `correct`: the rounding bound a right average that is not stock's lies in
    diagnosis.py  what a difference means: a factor, a source rank, a summation order
docs/grade.md shows each exercise and what the grader says.
"""
