"""Run support: what every example needs around the lesson, kept out of the lesson files.

For the examples (and scripts built like them):
    cli.py         the examples' flags, checked before torch loads (a typo costs a moment)
    errors.py      a UsageError or a failed collective as one line, a hint and an exit status
    toy.py         the lesson's data and model (ToyDataset, NeuralNetwork), accuracy
    checkpoint.py  save atomically on global rank 0, resume
    sharded_checkpoint.py  checkpoints any world size loads (PyTorch's distributed checkpoint)
    faults.py      an injected crash, to watch torchrun restart a job
    warm.py        ranks forked from a process that has imported torch and minddp already
    frozen.py      the fork server's imports set aside from the collector (warm.py)
    older_torch.py stock's pipeline schedules on torch 2.11 and 2.12, as 2.13 fixed them
"""
