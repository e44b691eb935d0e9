"""UsageError: the one error type of the lessons, a mistake in one line and a hint.

    python -c "from minddp import UsageError; print(UsageError('no data', hint='--factor 4'))"

Every lesson raises it for a mistake a student can fix (a plan naming a layer the model
lacks, a world size the batch does not divide); the examples print it as one line and a
`---> HINT:` line and exit with status 2 (run/errors.py). It imports nothing: any file of the
house may raise it without pulling the rest in.
"""


class UsageError(RuntimeError):
    """A mistake in how a run was set up: one line, and a hint on how to fix it.

    `same_on_every_rank=True` marks mistakes every rank detects alike (the data, the command
    line): only rank 0 prints them, not every rank.
    """

    def __init__(self, message, hint="", same_on_every_rank=False):
        """The mistake in one line; the hint says how to fix it."""
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.same_on_every_rank = same_on_every_rank

    def __str__(self):
        return self.message + (f" (hint: {self.hint})" if self.hint else "")
