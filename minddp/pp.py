"""Pipeline parallelism by hand: each rank a stage of the layers, microbatches flowing through.

    torchrun --nproc_per_node=2 examples/pipeline.py --pp manual --schedule 1f1b
    pytest tests/test_pp.py     # losses, gradients, weights, order: stock's, at 2 and 4 stages

DDP copies the whole model to every rank; a pipeline cuts it: rank s runs only stage s. The
batch is cut into m microbatches. Each travels forward stage to stage (the activation is
sent to the next rank), and its gradient travels back (the activation's gradient is sent to
the rank before). In the order they appear below:
  stage_layers    which layers stage s holds: an nn.Sequential cut evenly
  PipelineStage   one stage: forward one microbatch (recv, compute, send), backward one
                  (recv its output's gradient, backward, send its input's gradient)
  Schedule        one loop that runs a schedule, the list of a stage's actions (F0 F1 .. B0
                  ..: pp_schedules.py); step() cuts the batch, as stock's does; a stage
                  that is data-parallel too (fully_shard) reduces its gradients once
A stage idles until its first activation arrives, and again until its first gradient: the
bubble, (p-1)/(m+p-1) of a step with p stages. GPipe keeps all m microbatches' activations
until backward; 1F1B starts each backward as early as it can and keeps at most p - s.
Stock's API (torch.distributed.pipelining): PipelineStage(module, stage_index, num_stages,
device), ScheduleGPipe(stage, m, loss_fn) or Schedule1F1B, then step(x) on the first stage,
step(target=y, losses=[]) on the last, step() between.
"""

import torch
import torch.distributed as dist

from .usage_error import UsageError
from .groups import global_rank
from .pp_schedules import gpipe, one_f_one_b

MAX_DIMS = 8  # an activation's shape travels in a header of this many numbers


def stage_layers(model, stage_index, num_stages):
    """Stage `stage_index`'s layers of `model` (an nn.Sequential): cut into num_stages runs
    of consecutive layers, the first stages one longer where the count does not divide."""
    per, extra = divmod(len(model), num_stages)
    starts = [s * per + min(s, extra) for s in range(num_stages + 1)]
    # Every rank checks every stage: a stage refused on its own rank alone would leave the
    # others waiting for it.
    empty = [s for s in range(num_stages) if not list(model[starts[s]:starts[s + 1]].parameters())]
    if empty:
        raise UsageError(f"{num_stages} stages of a model of {len(model)} layers: stage"
                         f" {empty[0]} would hold no weights", same_on_every_rank=True,
                         hint="use fewer stages (ranks), so each holds a layer with weights")
    return model[starts[stage_index]:starts[stage_index + 1]]


class PipelineStage:
    """Stage `stage_index` of `num_stages`, on the rank of the same number: its layers and
    its neighbours, the rank before (activations come from it) and after (they go to it)."""

    def __init__(self, submodule, stage_index, num_stages, device=None, group=None):
        if dist.get_world_size(group) != num_stages:
            raise UsageError(f"{num_stages} stages on {dist.get_world_size(group)} ranks: this"
                             " pipeline runs one stage per rank", same_on_every_rank=True,
                             hint="start as many ranks as stages (--nproc_per_node)")
        if not list(submodule.parameters()):  # (found on this rank alone: it says so)
            raise UsageError(f"stage {stage_index} has no parameters",
                             hint="give every stage at least one layer with weights")
        self.submod, self.index, self.num_stages, self.group = submodule, stage_index, \
            num_stages, group
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        def rank(r):  # the global rank of stage r (send and recv take global ranks)
            return global_rank(group, r) if 0 <= r < num_stages else None
        self.prev, self.next = rank(stage_index - 1), rank(stage_index + 1)
        first = next(submodule.parameters())
        self.device, self.dtype = device or first.device, first.dtype
        self.inputs, self.outputs = {}, {}  # per microbatch: kept from forward to backward
        self.sending, self.log = [], []  # sends in flight; the actions taken ("F0", "B0", ...)

    def forward_one(self, i, x=None):
        """Microbatch i through this stage: its input from the stage before (or x, on the
        first), its output to the stage after. Kept for backward: input and output."""
        if not self.is_first:
            x = self.recv(self.prev).requires_grad_()  # a leaf: its .grad goes back
        output = self.submod(x)
        self.inputs[i], self.outputs[i] = x, output
        if not self.is_last:
            self.send(output.detach(), self.next)
        self.log.append(f"F{i}")
        return output

    def backward_one(self, i, loss=None):
        """Microbatch i's backward: from its loss (the last stage), or from the gradient of its
        output (received from the stage after); the gradient of its input goes back."""
        x, output = self.inputs.pop(i), self.outputs.pop(i)  # freed after this backward
        if self.is_last:
            torch.autograd.backward([loss])
        else:
            torch.autograd.backward([output], grad_tensors=[self.recv(self.next)])
        if not self.is_first:
            self.send(x.grad, self.prev)
        self.log.append(f"B{i}")

    def send(self, tensor, dst):
        # A receiver must allocate before it receives: the shape goes first, then the data.
        # Both are sent without waiting (isend): the next stage may not be receiving yet.
        shape = [tensor.dim(), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
        for t in (torch.tensor(shape, device=self.device), tensor.contiguous()):
            self.sending.append((t, dist.isend(t, dst, group=self.group)))

    def recv(self, src):
        header = torch.empty(MAX_DIMS + 1, dtype=torch.long, device=self.device)
        dist.recv(header, src, group=self.group)
        tensor = torch.empty(header[1:1 + header[0]].tolist(), dtype=self.dtype,
                             device=self.device)
        dist.recv(tensor, src, group=self.group)
        return tensor


class Schedule:
    """Runs one stage's list of actions for one batch: step() as stock's schedules."""

    actions = staticmethod(gpipe)

    def __init__(self, stage, n_microbatches, loss_fn=None):
        self.stage, self.n, self.loss_fn = stage, n_microbatches, loss_fn

    def step(self, *args, target=None, losses=None):
        """One batch through the pipeline; gradients left in .grad, the microbatches' mean.
        Returns the last stage's output (the microbatches' outputs, concatenated)."""
        stage, n = self.stage, self.n
        inputs = self._split(args[0]) if stage.is_first else [None] * n
        targets = self._split(target) if stage.is_last else None
        loss, outputs = {}, []
        actions = self.actions(stage.index, stage.num_stages, n)
        last = max(j for j, (kind, _) in enumerate(actions) if kind == "B")
        for j, (kind, i) in enumerate(actions):
            if kind == "F":
                output = stage.forward_one(i, inputs[i])
                if stage.is_last:
                    loss[i] = self.loss_fn(output, targets[i])
                    outputs.append(output.detach())
            else:
                sync_gradients(stage.submod, j == last)
                stage.backward_one(i, loss.get(i))
        for _, work in stage.sending:
            work.wait()
        stage.sending.clear()
        # Each microbatch's loss is a mean over its samples; the batch's is the mean of the
        # microbatches' (stock's scale_grads): divide the summed gradients by n, once.
        for p in stage.submod.parameters():
            if p.grad is not None:
                p.grad.div_(n)
        if losses is not None:
            losses.extend(loss[i].detach() for i in range(len(loss)))
        return torch.cat(outputs) if stage.is_last else None

    def _split(self, batch):
        if batch is None or len(batch) % self.n:
            raise UsageError(f"a batch of {None if batch is None else len(batch)} cannot be"
                             f" cut into {self.n} equal microbatches", same_on_every_rank=True,
                             hint="pass the batch (first stage) and target (last stage), with"
                                  " a batch size that n_microbatches divides")
        return batch.chunk(self.n)


def sync_gradients(module, last):
    """A stage that is data-parallel too sums its microbatches' gradients, and reduces the
    sum over its data-parallel ranks in its last backward only, as stock's schedules do."""
    if hasattr(module, "set_requires_gradient_sync"):  # fully_shard's (stock's names)
        module.set_requires_gradient_sync(last)
        module.set_reshard_after_backward(last)  # the weights stay gathered until then
    elif hasattr(module, "no_sync"):  # DDP decides at forward time: not the pipeline's way
        raise UsageError("a pipeline stage wrapped in DDP: minddp's pipeline syncs fully_shard"
                         " stages only", hint="fully_shard the stage over the dp dimension")


class ScheduleGPipe(Schedule):
    actions = staticmethod(gpipe)


class Schedule1F1B(Schedule):
    actions = staticmethod(one_f_one_b)
