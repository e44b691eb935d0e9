"""Pipeline schedules: for each stage, the list of its actions, and the one loop that runs them.

    pytest tests/test_pp.py -k order     # each stage's actions, in stock's order

A schedule is only the order of a stage's actions: ("F", i) runs microbatch i's forward and
sends its activation on, ("B", i) its backward and sends its gradient back. The order
decides two things: the bubble (how long a stage waits, first for its first activation,
then for its first gradient) and the memory (how many microbatches' activations a stage
keeps alive). In the order they appear below:
  gpipe, one_f_one_b   the two lists for one stage per rank
  Schedule             the loop: runs the list on stage.py's PipelineStage(s), step() as stock
  sync_gradients       a stage that is fully_shard-ed too reduces its gradients once
"""

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError


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


class Schedule:
    """Runs this rank's list of actions for one batch: step() as stock's schedules. One
    stage per rank here; interleaved.py's schedules take a list of stages."""

    actions = staticmethod(gpipe)

    def __init__(self, stage, n_microbatches, loss_fn=None):
        self.stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.stage, self.n, self.loss_fn = self.stages[0], n_microbatches, loss_fn
        ranks = dist.get_world_size(self.stage.group)
        if len(self.stages) == 1 and self.stage.num_stages != ranks:
            raise UsageError(f"{self.stage.num_stages} stages on {ranks} ranks:"
                             f" {type(self).__name__} runs one stage per rank",
                             same_on_every_rank=True, hint="start as many ranks as stages,"
                             " or give each rank its stages and an interleaved schedule")

    def order(self):
        """This rank's actions, (stage, "F" or "B", microbatch), in the order to run them."""
        return [(self.stage, kind, i)
                for kind, i in self.actions(self.stage.index, self.stage.num_stages, self.n)]

    def step(self, *args, target=None, losses=None):
        """One batch through the pipeline; gradients left in .grad, the microbatches' mean.
        Returns the last stage's output (the microbatches' outputs, concatenated)."""
        n, stages = self.n, self.stages
        first = [s for s in stages if s.is_first]
        inputs = self._split(args[0] if args else None, first[0]) if first else [None] * n
        try:
            targets = self._split(target) if any(s.is_last for s in stages) else None
        except UsageError as refused:
            # Raised at the first loss: a refusal of the batch itself, travelling from the
            # first stage, arrives before then and is the one every rank reports.
            targets = refused
        loss, outputs = {}, []
        actions = self.order()
        for stage in stages:  # learned again from this step's first activation (stage.py)
            stage.input_shape = None
        # a stage's last backward (or weight gradient) syncs its data-parallel ranks
        last = {s: max((j for j, (t, kind, _) in enumerate(actions) if t is s and kind != "F"),
                       default=None) for s in stages}
        for j, (stage, kind, i) in enumerate(actions):
            # This action's receive, then the next one's, posted before this one computes.
            for t, kind_ahead, i_ahead in actions[j:j + 2]:
                t.post(kind_ahead, i_ahead)
            if kind == "F":
                output = self.forward(stage, i, inputs[i])
                if stage.is_last:
                    if isinstance(targets, UsageError):
                        raise targets
                    loss[i] = self.loss_fn(output, targets[i])
                    outputs.append(output.detach())
            else:
                sync_gradients(stage.submod, j == last[stage])
                self.backward(stage, kind, i, loss.get(i))
        for stage in stages:
            for _, work in stage.sending:
                work.wait()
            stage.sending.clear()
            # Each microbatch's loss is a mean over its samples; the batch's is the mean of
            # the microbatches' (stock's scale_grads): divide the summed gradients by n, once.
            for p in stage.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(n)
        if losses is not None:
            losses.extend(loss[i].detach() for i in range(len(loss)))
        return torch.cat(outputs) if outputs else None

    def forward(self, stage, i, x):
        """One forward action (zero bubble keeps more of it: zero_bubble.py)."""
        return stage.forward_one(i, x)

    def backward(self, stage, kind, i, loss):
        """One backward action: "B", the whole backward (zero bubble splits it: I and W)."""
        stage.backward_one(i, loss)

    def _split(self, batch, first_stage=None):
        if batch is None or len(batch) % self.n:
            size = -1 if batch is None else len(batch)
            if first_stage is not None:  # the batch: every stage after is told (stage.py)
                first_stage.refuse(size, self.n)
            raise UsageError(f"a target of {None if batch is None else size} cannot be cut"
                             f" into {self.n} equal microbatches", hint="pass the target"
                             " (last stage) with a batch size that n_microbatches divides")
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
