"""Which parameters did this forward not use? A walk of the autograd graph, as stock does.

    pytest tests/test_contract.py -k 2     # find_unused_parameters=True against stock DDP

With find_unused_parameters=True, ManualDDP calls this after every training forward. A
parameter outside the graph will get no gradient in this backward, so no hook will ever
say it is ready; its bucket would wait forever. Found here, it is marked ready (with a
zero contribution) as soon as backward starts (ddp.py). Stock DDP walks the same graph,
in C++ (Reducer::prepare_for_backward).
"""

import torch


def unused_parameters(output, params):
    """Indices of `params` that this forward's autograd graph does not reach."""
    # Walk the graph back from every output tensor; a parameter shows up as the
    # `variable` of an AccumulateGrad node. Stock does the same walk in C++.
    stack, seen, reached = [], set(), set()
    _collect_grad_fns(output, stack)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return [i for i, p in enumerate(params) if id(p) not in reached]


def _collect_grad_fns(output, stack):
    if isinstance(output, torch.Tensor):
        stack.append(output.grad_fn)
    elif isinstance(output, dict):
        for value in output.values():
            _collect_grad_fns(value, stack)
    elif isinstance(output, (list, tuple)):
        for value in output:
            _collect_grad_fns(value, stack)
