"""When sequence parallel's LayerNorm gradients are summed over tp, under stock's wrappers.

    pytest tests/test_mesh.py -k microbatches   # DDP and fully_shard over SP, accumulating

tp/sequence_parallel.py sums each rank's own gradient of a LayerNorm weight, its microbatches added first,
over tp: stock's Partial gradient as the optimizer reads it. Stock's wrappers move that sum:
  DDP          trains local copies of the weights and makes a DTensor of each in forward;
               that DTensor's backward hands the copy a whole gradient: each backward's
               gradient summed over tp on its own, and the sums added.
  fully_shard  keeps the Partial gradient, adds the no-sync microbatches to it, and sums it
               over tp just before it reduces over dp (its _get_grad_inner_tensor).
Microbatches added before or after the sum round differently, so each order is stock's.
"""

import weakref

from ..tp.sequence_parallel import SUM_HOOKS, summed

# id(weight) -> (a weak reference to it, its tp group), for fully_shard's reduce. By id: a
# WeakKeyDictionary compares tensors with ==, elementwise, on weights whose bytes are freed.
# An entry leaves with its weight: kept, it would hold the group past its destroy.
_PARTIAL = {}


def sum_each_backward(model):
    """DDP's order: each backward's gradient summed over tp on its own."""
    for module in model.modules():
        SUM_HOOKS[module] = lambda param, group: (lambda grad: summed(grad, group))


def leave_partial(model):
    """fully_shard's order: this rank's gradient left as it is; summed_if_partial sums it."""
    def make_hook(param, group):
        key = id(param)
        _PARTIAL[key] = (weakref.ref(param, lambda _: _PARTIAL.pop(key, None)), group)
        return lambda grad: grad  # autograd adds the microbatches: this rank's own sum
    for module in model.modules():
        SUM_HOOKS[module] = make_hook


def summed_if_partial(param, grad):
    """Collective over tp for a weight left partial: its gradient summed; others as they are."""
    ref, group = _PARTIAL.get(id(param), (None, None))
    return grad if ref is None or ref() is not param else summed(grad, group)
