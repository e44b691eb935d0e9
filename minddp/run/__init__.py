"""Run support: what every example needs around the lesson, kept out of the lesson files.

For the examples (and scripts built like them):
    cli.py         the examples' flags, checked before torch loads (a typo costs a moment)
    errors.py      a UsageError or a failed collective as one line, a hint and an exit status
    toy.py         the lesson's data and model (ToyDataset, NeuralNetwork), accuracy
    checkpoint.py  save atomically on global rank 0, resume
    faults.py      an injected crash, to watch torchrun restart a job
"""
