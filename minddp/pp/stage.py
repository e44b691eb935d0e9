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
  Schedule        (schedules.py) one loop that runs a schedule, the list of a stage's
                  actions (F0 F1 .. B0 ..); step() cuts the batch, as stock's does; a stage
                  that is data-parallel too (fully_shard) reduces its gradients once
Several stages per rank (virtual stages) and their schedules: interleaved.py.
A stage idles until its first activation arrives, and again until its first gradient: the
bubble, (p-1)/(m+p-1) of a step with p stages. GPipe keeps all m microbatches' activations
until backward; 1F1B starts each backward as early as it can and keeps at most p - s.
Stock's API (torch.distributed.pipelining): PipelineStage(module, stage_index, num_stages,
device), ScheduleGPipe(stage, m, loss_fn) or Schedule1F1B, then step(x) on the first stage,
step(target=y, losses=[]) on the last, step() between.
"""

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError
from ..launch.groups import global_rank

MAX_DIMS = 8  # an activation's shape travels in a header of this many numbers
REFUSED = -1  # a header's first number when the batch was refused upstream (refuse())
LOCAL = {}  # tag -> tensors handed from a stage to a neighbour stage on the same rank


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
    """Stage `stage_index` of `num_stages`, on rank stage_index % ranks (one stage per rank:
    the rank of the same number): its layers and its neighbours, the ranks of the stages
    before (activations come from it) and after (they go to it)."""

    def __init__(self, submodule, stage_index, num_stages, device=None, group=None):
        ranks = dist.get_world_size(group)
        if num_stages % ranks:
            raise UsageError(f"{num_stages} stages on {ranks} ranks: the stages must share"
                             " the ranks evenly", same_on_every_rank=True,
                             hint="start as many ranks as stages (--nproc_per_node), or a"
                                  " number of ranks that divides them")
        if not list(submodule.parameters()):  # (found on this rank alone: it says so)
            raise UsageError(f"stage {stage_index} has no parameters",
                             hint="give every stage at least one layer with weights")
        self.submod, self.index, self.num_stages, self.group = submodule, stage_index, \
            num_stages, group
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.place(lambda s: s % ranks)  # a loop; a V-shaped schedule places them again
        first = next(submodule.parameters())
        self.device, self.dtype = device or first.device, first.dtype
        self.inputs, self.outputs = {}, {}  # per microbatch: kept from forward to backward
        self.sending, self.log = [], []  # sends in flight; the actions taken ("F0", "B0", ...)
        self.posted, self.input_shape = {}, None  # receives posted ahead; this step's shape

    def place(self, rank_of_stage):
        """Where the neighbours sit: rank_of_stage(s) is the group rank holding stage s."""
        def rank(s):  # the global rank of stage s (send and recv take global ranks)
            return global_rank(self.group, rank_of_stage(s)) if 0 <= s < self.num_stages \
                else None
        self.prev, self.next = rank(self.index - 1), rank(self.index + 1)

    def forward_one(self, i, x=None):
        """Microbatch i through this stage: its input from the stage before (or x, on the
        first), its output to the stage after. Kept for backward: input and output."""
        if not self.is_first:
            x = self.recv("F", i).requires_grad_()  # a leaf: .grad goes back
        output = self.submod(x)
        self.inputs[i], self.outputs[i] = x, output
        if not self.is_last:
            self.send(output.detach(), self.next, self.index, header=i == 0)
        self.log.append(f"F{i}")
        return output

    def backward_one(self, i, loss=None):
        """Microbatch i's backward: from its loss (the last stage), or from the gradient of its
        output (received from the stage after); the gradient of its input goes back."""
        grad = None if self.is_last else self.recv("B", i)  # shaped as the output kept
        x, output = self.inputs.pop(i), self.outputs.pop(i)  # freed after this backward
        if self.is_last:
            torch.autograd.backward([loss])
        else:
            torch.autograd.backward([output], grad_tensors=[grad])
        if not self.is_first:
            self.send(x.grad, self.prev, self.index - 1, 1)
        self.log.append(f"B{i}")

    def send(self, tensor, dst, link, backward=0, header=False):
        # The tag names the link (stage link to link + 1) and the direction: two ranks that
        # share several links (virtual stages) keep each one's messages apart. Sent without
        # waiting (isend): the next stage may not be receiving yet.
        tag = 2 * link + backward
        if dst == dist.get_rank():  # the neighbour stage is on this rank too (a V's turn)
            LOCAL.setdefault(tag, []).append(tensor)
            return
        # A receiver must allocate before it receives. The step's first activation on a link
        # sends its shape first (a header); the microbatches after it have the same shape,
        # a gradient its activation's: one message each.
        shape = [tensor.dim(), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
        for t in ([torch.tensor(shape, device=self.device)] if header else []) + [tensor]:
            t = t.contiguous()
            self.sending.append((t, dist.isend(t, dst, group=self.group, tag=tag)))

    def expects(self, kind, i):
        """What action (kind, i) receives, if its shape is known before the message comes:
        (source rank, tag, shape); None when it receives nothing from another rank, or
        receives the step's first activation on its link (a header gives the shape)."""
        if kind == "F" and not self.is_first and i > 0 and self.input_shape is not None:
            src, tag, shape = self.prev, 2 * (self.index - 1), self.input_shape
        elif kind in "BI" and not self.is_last and i in self.outputs:
            src, tag, shape = self.next, 2 * self.index + 1, self.outputs[i].shape
        else:
            return None
        return None if src == dist.get_rank() else (src, tag, shape)

    def post(self, kind, i):
        """Post action (kind, i)'s receive (irecv) before it runs, if its shape is known: the
        message arrives while this rank computes (stock: batch_isend_irecv). Posted in the
        order of the actions: two messages on one link never land in each other's buffers."""
        expected = self.expects(kind, i)
        if expected is not None and (kind, i) not in self.posted:
            src, tag, shape = expected
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.posted[kind, i] = (tensor, dist.irecv(tensor, src, group=self.group, tag=tag))

    def recv(self, kind, i):
        """Action (kind, i)'s tensor: an activation ("F") from the stage before, or the
        gradient of its output ("B", "I") from the stage after."""
        src, tag = (self.prev, 2 * self.index - 2) if kind == "F" else \
            (self.next, 2 * self.index + 1)
        if src == dist.get_rank():
            return LOCAL[tag].pop(0)
        if kind == "F" and i == 0:  # the step's first activation: its shape first, a header
            header = torch.empty(MAX_DIMS + 1, dtype=torch.long, device=self.device)
            dist.recv(header, src, group=self.group, tag=tag)
            if header[0] == REFUSED:  # the first stage refused the batch: so does this one
                self.refuse(*header[1:3].tolist())
            self.input_shape = torch.Size(header[1:1 + header[0]].tolist())
            tensor = torch.empty(self.input_shape, dtype=self.dtype, device=self.device)
            dist.recv(tensor, src, group=self.group, tag=tag)
            return tensor
        self.post(kind, i)  # (mostly posted already, ahead of the action)
        tensor, work = self.posted.pop((kind, i))
        work.wait()
        return tensor

    def refuse(self, batch, n):
        """Refuse a batch of `batch` samples (-1: none given) that n microbatches do not divide,
        here and on every stage after. Only the first stage sees the batch; a middle stage
        would wait for an activation that never comes. So the refusal travels the pipeline in
        the first activation's place, to stages 1 .. ranks-1 (one on each rank, in a loop as
        in a V), and every rank stops at the same point, with the same line."""
        if self.index + 1 < dist.get_world_size(self.group):
            header = [REFUSED, batch, n] + [0] * (MAX_DIMS - 2)
            dist.send(torch.tensor(header, device=self.device), self.next, group=self.group,
                      tag=2 * self.index)  # blocking: the next rank's first recv takes it
        raise UsageError(f"a batch of {batch if batch >= 0 else None} cannot be cut into {n}"
                         " equal microbatches", same_on_every_rank=True,
                         hint="pass the batch (first stage) and target (last stage), with a"
                              " batch size that n_microbatches divides")
