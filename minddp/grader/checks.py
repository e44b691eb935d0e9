"""Every exercise's check, by name: what grade.py's ranks run (CHECKS[exercise]).

    minddp grade exercises/naive.py      # checks.CHECKS["naive"] on every rank
"""

from . import clip, context, ddp, experts, lessons, pieces, schedules, sharded, tp

CHECKS = {"tp": tp.tp, **ddp.CHECKS, **sharded.CHECKS, **pieces.CHECKS, **schedules.CHECKS,
          **lessons.CHECKS, **experts.CHECKS, **clip.CHECKS, **context.CHECKS}
