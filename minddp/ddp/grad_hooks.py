"""How a data-parallel wrapper hears of gradients: a hook per parameter, a call when it is over.

    pytest tests/test_ddp.py tests/test_buckets.py     # both wrappers, bitwise vs stock DDP

NaiveDDP (naive.py) and BucketedDDP (bucketed.py) average gradients while backward runs.
Two things from autograd tell them when:
  register_post_accumulate_grad_hook(fn)   fn(param) runs once param.grad holds this
      backward's gradient, plus whatever no_sync() accumulated: the tensor the optimizer reads
  at_end_of_backward(fn)   fn() runs once, when the whole backward has finished: the moment
      to check that every gradient came, and to wait for what is still in flight
  after_backward_of(inputs, fn)   fn() runs once the gradients of a module's inputs (and
      so of all its weights) are done: FSDP's moment to reduce a unit's gradients
And two rules: a hook holds its wrapper weakly (weakly), and a parameter that got no
gradient is named at the end of backward (missing_gradients_error), never waited for.
"""

import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..launch.usage_error import UsageError


def weakly(method):
    """`method`, holding its object weakly: a hook that does nothing once the wrapper is gone.

    A parameter holds its hooks. A hook holding the wrapper strongly closes a cycle (parameter
    -> hook -> wrapper -> module -> parameter) through the tensor's C++ side, where Python's
    garbage collector cannot see it: the wrapper, and the process group it holds, never go.
    """
    ref = weakref.WeakMethod(method)
    return lambda *args: None if ref() is None else ref()(*args)


def at_end_of_backward(fn):
    """Call fn() once, when the backward now running has finished."""
    # queue_callback is private, but stock DDP's Python side and FSDP use it too.
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def missing_gradients_error(missing):
    """The error for parameters that require grad but got none in a synced backward."""
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return UsageError(f"parameter {missing[0]!r} requires grad but got no gradient in this"
                      f" backward{more}",
                      hint="use it in forward so it reaches the loss, or freeze it with"
                           " requires_grad_(False) before wrapping the model (or pass"
                           " find_unused_parameters=True to ManualDDP, as to stock DDP)")


def after_backward_of(inputs, fn):
    """`inputs` (any nest of args), each tensor that needs a gradient passed through one
    autograd node whose backward calls fn(), once: after the gradients of all of them.

    Returns the new nest, for the module to compute with, or None if nothing needs a gradient.
    Why a node and not a hook on the tensors: a hook on a leaf input (a pipeline stage's
    received activation) may run before autograd has accumulated the weights' gradients;
    a node made before the module's forward runs after all of them (stock does the same).
    """
    flat, spec = tree_flatten(inputs)
    chosen = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
    if not chosen or not torch.is_grad_enabled():
        return None
    passed = _CallAfterBackward.apply(fn, *[flat[i] for i in chosen])
    for i, tensor in zip(chosen, passed):
        flat[i] = tensor
    return tree_unflatten(flat, spec)


class _CallAfterBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        ctx.set_materialize_grads(False)  # an input that gets no gradient keeps None
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)
