"""Zero bubble: the backward split in two, I now and W later, the Ws filling the bubble.

    pytest tests/test_pp_interleaved.py -k zero   # actions and bits: stock's

A backward computes two things: the gradient of the stage's input (the stage before waits
for it) and the gradients of the stage's weights (nobody waits for those until the
optimizer step). Split them: I (backward input) runs at once and sends its gradient back;
W (backward weight) runs whenever the rank would otherwise idle. Here I is
`torch.autograd.grad(output, input, retain_graph=True)`, with a hook on the output of each
layer that has weights keeping the gradient that flows into it; W starts from those kept
gradients, `torch.autograd.grad(layer output, its weights, kept gradient)`, so nothing is
computed twice. The first stage has no input gradient to send: its I waits for nothing,
and its W is the whole backward (as stock's). In the order they appear below:
  add_bubbles      stock's pass over all ranks' lists: None where a forward would run early
  ZeroBubble       the runner of interleaved.py with I and W as actions of their own
  backward_input, backward_weight   I and W
  ScheduleInterleavedZeroBubble     ZB1P: interleaved 1F1B, each B split (interleaved.py)
The V-shaped zero-bubble schedules (ZBV, DualPipeV): v_shaped.py.
Stock's API: ScheduleInterleavedZeroBubble(stages, m, loss_fn); step() as before.
"""

import functools

import torch

from .interleaved import ScheduleMulti, interleaved_1f1b, parse_action
from ..launch.usage_error import UsageError


def add_bubbles(lists, num_stages):
    """Stock's _add_bubbles_to_actions: walk all ranks' lists a slot at a time; a forward
    whose input the stage before has not made in an earlier slot waits (None) instead."""
    done, result, at = set(), [[] for _ in lists], [0] * len(lists)
    while any(at[r] < len(lists[r]) for r in range(len(lists))):
        now = set()
        for r, actions in enumerate(lists):
            if at[r] >= len(actions):
                continue
            action = actions[at[r]]
            stage, kind, i = parse_action(action) if action else (None, None, None)
            if action and kind == "F" and stage and (stage - 1, "F", i) not in done:
                result[r].append(None)  # wait: the activation is not there yet
                continue
            result[r].append(action)
            if action:
                now.add((stage, kind, i))
            at[r] += 1
        done |= now
    return result


class ZeroBubble(ScheduleMulti):
    """interleaved.py's runner; its forwards keep each weighted layer's output for W."""

    def forward(self, stage, i, x):
        kept = []  # (layer's output, the layer's own weights), in forward order
        hooks = [m.register_forward_hook(functools.partial(_keep, kept))
                 for m in stage.submod.modules() if list(m.parameters(recurse=False))]
        try:
            return stage.forward_one(i, x)
        finally:
            for hook in hooks:
                hook.remove()
            stage.kept = getattr(stage, "kept", {})
            stage.kept[i] = kept

    def backward(self, stage, kind, i, loss):
        if kind == "B":
            return stage.backward_one(i, loss)
        if kind == "I":
            return backward_input(stage, i, loss)
        return backward_weight(stage, i)


def _keep(kept, module, args, output):
    kept.append((output, list(module.parameters(recurse=False))))


def backward_input(stage, i, loss):
    """I: the input's gradient only, sent back at once; each layer's gradient kept for W."""
    x, output = stage.inputs[i], stage.outputs[i]
    outputs, grads = ([loss], [torch.ones_like(loss)]) if stage.is_last else \
        ([output], [stage.recv("I", i)])
    kept = stage.kept.pop(i)
    flowing = [None] * len(kept)  # the gradient into each weighted layer's output
    if not stage.is_first:
        hooks = [y.register_hook(functools.partial(_flowing, flowing, j))
                 for j, (y, _) in enumerate(kept)]
        try:
            (x.grad,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True)
        finally:
            for hook in hooks:
                hook.remove()
        stage.send(x.grad, stage.prev, stage.index - 1, 1)
    stage.split = getattr(stage, "split", {})
    stage.split[i] = (outputs, grads, kept, flowing)
    stage.log.append(f"I{i}")


def _flowing(flowing, j, grad):
    flowing[j] = grad


def backward_weight(stage, i):
    """W: each weighted layer's weight gradients from the gradient I kept, added to .grad;
    on the first stage (no input gradient was needed) the whole backward, as stock's."""
    if i not in getattr(stage, "split", {}):  # a list that puts a W before its I
        raise UsageError(f"stage {stage.index}: W{i} before I{i}: the weights' gradients start"
                         " from what I kept", hint="in each stage's list, every W after its I")
    outputs, grads, kept, flowing = stage.split.pop(i)
    stage.inputs.pop(i), stage.outputs.pop(i)
    if stage.is_first:
        torch.autograd.backward(outputs, grad_tensors=grads)
    for (y, weights), grad in zip(kept, flowing) if not stage.is_first else ():
        if grad is None:
            continue  # a layer whose output did not reach the stage's output
        for p, g in zip(weights, torch.autograd.grad([y], weights, [grad])):
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g
    stage.log.append(f"W{i}")


class ScheduleInterleavedZeroBubble(ZeroBubble):
    """ZB1P: interleaved 1F1B with each B split, Ws where the rank would wait."""

    def order(self):  # the bubbles are found over every rank's list at once
        lists = [interleaved_1f1b(r, self.pp, self.n_local, self.n, zero_bubble=True)
                 for r in range(self.pp)]
        return self.parsed(add_bubbles(lists, self.stage.num_stages)[self.rank])
