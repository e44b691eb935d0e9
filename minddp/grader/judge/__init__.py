"""What a difference from stock means: the mistake named, or a right result within a bound.

    minddp grade exercises/naive.py --ranks 3     # "correct", with what differs from stock

    diagnosis.py  a run beside stock's: the first element apart and its likeliest cause (a
                  factor of the world size, a source rank, a summation order, the optimizer)
    bound.py      `correct`: the rounding bound a right average, sum or norm that is not
                  stock's bits lies in
"""
