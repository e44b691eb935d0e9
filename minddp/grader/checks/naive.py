"""NaiveDDP's check: the student's NaiveDDP beside stock DDP, step by step.

    minddp grade exercises/naive.py      # grade.py runs CHECKS["naive"] on every rank

What every DDP is graded on (shared/data_parallel.py): both models of shared/training.py,
each rank its own first weights and batches; a step in two halves, the first under
no_sync(); a layer the forward never uses; (3+ ranks) a process group without rank 0. One
all_reduce per parameter adds 3 or more ranks in another order than stock's buckets: graded
against the exact average (judge/bound.py), `correct` within the bound.
"""

from ..shared.data_parallel import on_the_edges, on_the_models

ORDER_NOTE = ("stock adds each bucket's gradients, pre-divided by the world size, with one"
              " all_reduce; one per parameter adds 3 or more ranks' in another order")


def naive(student, rank, world_size):
    """NaiveDDP against stock DDP: the models, then what they do not reach."""
    return (on_the_models(student, rank, world_size, "NaiveDDP", ORDER_NOTE)
            + on_the_edges(student, rank, world_size, "NaiveDDP", ORDER_NOTE))
