"""Instruments: what a run did, recorded and compared, never part of the training itself.

For anyone checking a lesson's claim ("bit for bit equal to stock") or looking inside a run:
    gradtable.py      every synced gradient, per step, rank and parameter, recorded
    tables.py         the table files (written on rank 0, read by diff; no torch needed)
    diff.py           `minddp diff A B`: two tables element by element, and why bits differ
    across.py         two tables of different meshes: whole gradients, the first difference
    replicas.py       do all ranks hold the same weights? (check_replicas)
    timeline.py       backward and each all-reduce recorded from outside, as a Chrome trace
    overlap.py        reading a timeline: the overlap share, a text picture of one step
    pictures.py       the timeline and memory pictures (PNG, matplotlib)
    bubble.py         the pipeline's bubble: each stage's forwards, backwards, waits (PNG)
    tree_picture.py   the invariant mode's tree of shards on every dp, and its price (PNG)
    pipeline_slots.py `minddp pp-schedules`: every schedule's actions laid out in time
    whole_tensors.py  a sharded model's whole weights and gradients (FSDP), to save and compare
    course.py         `minddp lessons`: the reading order, each file's size and idea
    memory.py         `minddp memory`: what one rank will hold, line by line, with formulas
They reach the lessons only from outside (hooks registered after the wrapper's, and the calls
a lesson names for it: tp/plan.py's sliced, fsdp/param.py's unit_of), so recording changes no
number.
"""
