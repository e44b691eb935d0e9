"""When sequence parallel's LayerNorm gradients are summed over tp, under stock's wrappers.

    pytest tests/test_mesh.py -k microbatches   # DDP and fully_shard over SP, accumulating

tp/sequence_parallel.py keeps each LayerNorm weight a DTensor whose gradient stays Partial
(this rank's own sum, its microbatches added) until it is read: stock's gradient on its own.
Stock's wrappers take those weights over and move the sum:
  DDP          trains local copies of the weights and makes a DTensor of each in forward;
               that DTensor's backward hands the copy a whole gradient: each backward's
               gradient summed over tp on its own, and the sums added.
  fully_shard  keeps the Partial gradient, adds the no-sync microbatches to it, and sums it
               over tp just before it reduces over dp (its _get_grad_inner_tensor).
Microbatches added before or after the sum round differently, so each order is stock's. Here
each wrapper turns the weights back into plain tensors (this rank's copy) and hooks them.
"""

import weakref

import torch
import torch.distributed as dist

from ..tp.sequence_parallel import WEIGHTS

# id(weight) -> (a weak reference to it, its tp group), for fully_shard's reduce. By id: a
# WeakKeyDictionary compares tensors with ==, elementwise, on weights whose bytes are freed.
# An entry leaves with its weight: kept, it would hold the group past its destroy.
_PARTIAL = {}


def summed(grad, group):
    """Collective over tp: a copy of grad, summed over the group's ranks."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def sum_each_backward(model):
    """DDP's order: each backward's gradient summed over tp on its own."""
    _take_over(model, lambda param, group: (lambda grad: summed(grad, group)))


def leave_partial(model):
    """fully_shard's order: this rank's gradient left as it is; summed_if_partial sums it."""
    def make_hook(param, group):
        key = id(param)
        _PARTIAL[key] = (weakref.ref(param, lambda _: _PARTIAL.pop(key, None)), group)
        return lambda grad: grad  # autograd adds the microbatches: this rank's own sum
    _take_over(model, make_hook)


def summed_if_partial(param, grad):
    """Collective over tp for a weight left partial: its gradient summed; others as they are."""
    ref, group = _PARTIAL.get(id(param), (None, None))
    return grad if ref is None or ref() is not param else summed(grad, group)


def _take_over(model, make_hook):
    """Each SequenceParallel weight in `model` becomes a plain Parameter, this rank's copy,
    whose gradient make_hook(weight, tp group) hooks at every forward."""
    for module in model.modules():
        weights = WEIGHTS.pop(module, {})
        for attr, whole in weights.items():
            if module._parameters.get(attr) is whole:
                local = whole.to_local().detach()
                module._parameters[attr] = torch.nn.Parameter(local, whole.requires_grad)
        if weights:
            group = next(iter(weights.values())).device_mesh.get_group()
            hooked = []
            module.register_forward_pre_hook(
                lambda m, args, hooked=hooked, group=group: _hook(m, group, hooked, make_hook))


def _hook(module, group, hooked, make_hook):
    # The hook goes on the tensors the module holds *at forward time*: a wrapper applied
    # after this one (fully_shard) swaps in parameters of its own, and a hook on the replaced
    # tensor would never fire. Each tensor gets it once (weak references: a tensor may go).
    hooked[:] = [ref for ref in hooked if ref() is not None]
    for param in module.parameters(recurse=False):
        if param.requires_grad and not any(ref() is param for ref in hooked):
            hooked.append(weakref.ref(param))
            param.register_hook(make_hook(param, group))
