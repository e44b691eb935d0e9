"""Pipeline schedules: for each stage, the list of its actions, F(orward) and B(ackward) i.

    pytest tests/test_pp.py -k order     # each stage's actions, in stock's order

pp.py's Schedule runs any such list, one action at a time: ("F", i) sends microbatch i's
activation on, ("B", i) its gradient back. A schedule is only the order. It decides two
things: the bubble (how long a stage waits, first for its first activation, then for its
first gradient) and the memory (how many microbatches' activations a stage keeps alive).
"""


def gpipe(stage_index, num_stages, n):
    """GPipe: every forward, then every backward (all n activations alive at the turn)."""
    return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]


def one_f_one_b(stage_index, num_stages, n):
    """1F1B: a warm-up of forwards (as stock: num_stages - stage_index of them), then one
    backward, one forward, ..., then the backwards left. At most that many alive at once."""
    warmup = min(n, num_stages - stage_index)
    actions, forwards, backwards = [("F", i) for i in range(warmup)], warmup, 0
    while backwards < n:
        actions.append(("B", backwards))
        backwards += 1
        if forwards < n:
            actions.append(("F", forwards))
            forwards += 1
    return actions
