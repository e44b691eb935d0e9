"""ManualDDP: stock DistributedDataParallel by hand, with buckets that overlap backward.

    torchrun --nproc_per_node=2 examples/manual_ddp.py

The contract and the moves are NaiveDDP's (naive.py: broadcast at construction, a hook
per parameter, forward untouched); read that first. What changes is how the gradients
travel. Instead of one blocking all_reduce per parameter, each hook copies its gradient
into a flat bucket, and a full bucket is all-reduced *asynchronously* while autograd
goes on computing the gradients of the layers below (buckets.py). At the end of
backward every bucket is waited for and the averages are copied back into `.grad`.

Stock's knobs, by stock's names and defaults, bitwise equal to stock with the same
setting (tests/test_contract.py; what each does: docs/buckets.md): broadcast_buffers,
gradient_as_bucket_view, find_unused_parameters, register_comm_hook(state, hook).
"""

import contextlib

import torch
import torch.distributed as dist

from .buckets import (Bucket, GradBucket, aliases, assign_buckets, bucket_size_limits,
                      check_bucketable, expects_sparse_gradient)
from .errors import UsageError
from .hooks import hook_result
from .naive import NaiveDDP
from .unused import unused_parameters


class ManualDDP(NaiveDDP):
    def __init__(self, module, process_group=None, bucket_cap_mb=None, broadcast_buffers=True,
                 gradient_as_bucket_view=False, find_unused_parameters=False):
        super().__init__(module, process_group, broadcast_buffers)
        check_bucketable(self._param_names, self._params)  # one clear error, at wrap time
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.size_limits = bucket_size_limits(bucket_cap_mb)
        self._sparse = {i for i, p in enumerate(self._params) if expects_sparse_gradient(module, p)}
        if find_unused_parameters:
            # Which parameters take part may change every step, so the arrival order of
            # one step says little about the next: stock sizes the buckets from the start,
            # last parameters first, and never rebuilds them.
            layout = assign_buckets(self._params, self.size_limits, sparse=self._sparse)[::-1]
        else:
            # Before any backward nobody knows in which order gradients arrive: one
            # bucket, rebuilt after the first synced backward (rebuild_buckets).
            layout = assign_buckets(self._params, [float("inf")], sparse=self._sparse)
        self._initialize_buckets(layout)
        self._rebuilt = find_unused_parameters or not self._params
        self._ready_order = []  # parameter indices in the order their gradients arrived
        self._comm_hook = None  # (state, hook)
        self._backwards = 0  # synced backwards so far
        self._unused = []  # find_unused_parameters: not in this forward's graph
        self._used = torch.zeros(len(self._params), dtype=torch.int32)  # used here, this step
        self._used_work = None

    def _initialize_buckets(self, layout):
        self.buckets = [Bucket(self._params, indices) for indices in layout]
        self._locator = {}  # parameter index -> (bucket, its view)
        for bucket in self.buckets:
            for i, view in zip(bucket.indices, bucket.views):
                self._locator[i] = (bucket, view)
                p = self._params[i]
                moved = p.grad is not None and not aliases(p.grad, view)
                if self.gradient_as_bucket_view and moved:
                    view.copy_(p.grad)  # after a rebuild, .grad moves into its new bucket
                    p.grad = view
        self._next_bucket = 0

    def register_comm_hook(self, state, hook):
        """Reduce each bucket with hook(state, bucket) -> Future[Tensor], stock's signature.

        The hook gets the bucket's buffer undivided: averaging is its job (minddp/hooks.py).
        """
        if self._comm_hook is not None:
            raise UsageError("register_comm_hook can only be called once",
                             hint="register one hook; to combine two, write one that calls both")
        if self._backwards:
            raise UsageError("register_comm_hook after training started",
                             hint="register the hook right after wrapping the model,"
                                  " before any backward")
        self._comm_hook = (state, hook)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._rebuild_buckets()  # once, after the first synced backward
        output = super().forward(*args, **kwargs)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.find_unused_parameters and synced:
            self._unused = unused_parameters(output, self._params)
        return output

    def _rebuild_buckets(self):
        if self._rebuilt or len(self._ready_order) != len(self._params):
            return
        order = torch.tensor(self._ready_order, device=self._params[0].device)
        if self.world_size > 1:
            # Every rank must pack the same buckets or the all_reduces would pair up
            # different parameters; stock settles it the same way: rank 0's order wins.
            group = self.process_group
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast(order, src=src, group=group)
        self._initialize_buckets(assign_buckets(self._params, self.size_limits, order.tolist(),
                                                sparse=self._sparse))
        self._rebuilt = True

    def _hook(self, index, param):
        if self.find_unused_parameters and param.grad is not None:
            self._used[index] = 1  # used here: in no_sync() too, it counts for the next sync
        super()._hook(index, param)

    def _average(self, index, param):
        if not self._rebuilt:
            self._ready_order.append(index)
        if self._unused:
            # find_unused_parameters: the parameters outside this step's graph will get
            # no hook, so they are ready now; their buckets can then fill and leave.
            unused, self._unused = self._unused, []
            for i in unused:
                self._mark_ready(i)
        self._mark_ready(index)

    def _mark_ready(self, index):
        bucket, view = self._locator[index]
        param = self._params[index]
        grad, hook = param.grad, self._comm_hook
        if grad is None and index in self._sparse:
            raise UsageError(f"parameter {self._param_names[index]!r} expects a sparse gradient"
                             f" but got none on this rank: a sparse bucket has nothing to send",
                             hint="use the embedding on every rank in every step (stock DDP"
                                  " raises 'Expected sparse gradient to be defined')")
        if grad is None:
            view.zero_()  # unused on this rank (find_unused_parameters): it adds nothing
        elif grad.is_sparse:
            # A sparse bucket is its one gradient, sent as it is (gloo sums sparse tensors),
            # divided in place first, as stock divides it.
            if hook is None:
                grad.div_(self.world_size)
            bucket.flat = grad
        elif aliases(grad, view):
            # gradient_as_bucket_view: autograd accumulated into the bucket itself.
            if hook is None:
                view.div_(self.world_size)
        else:
            if hook is None:
                # Divide while copying into the bucket, one pass over the gradient: each
                # rank sends g_r / world_size, so the sum that comes back is the mean.
                torch.mul(grad, 1.0 / self.world_size, out=view)
            else:
                view.copy_(grad)  # a hook gets the sum's addends whole; it divides
            if self.gradient_as_bucket_view:
                param.grad = view  # from now on .grad is the bucket: no copy back later
        bucket.pending -= 1
        # Launch strictly in bucket order, on every rank the same: collectives pair up by
        # the order they are issued, so bucket 1 may not overtake bucket 0 even if ready.
        buckets = self.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1
        all_sent = self._next_bucket == len(buckets)
        if all_sent and self.find_unused_parameters and self.world_size > 1:
            # Which parameters did *any* rank use? A parameter unused everywhere keeps
            # its .grad untouched (None stays None); used somewhere, it gets the average.
            self._used_anywhere = self._used.clone()  # reduced in flight; self._used stays local
            self._used_work = dist.all_reduce(self._used_anywhere, group=self.process_group,
                                              async_op=True)

    def _launch(self, position):
        bucket = self.buckets[position]
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            bucket.work = hook(state, GradBucket(bucket, position, len(self.buckets)))
        elif self.world_size > 1:
            # async_op: returns at once; the reduction runs in the backend's own thread
            # while autograd goes on computing the earlier layers' gradients.
            bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        if self.timeline and bucket.work is not None:
            self.timeline.comm(f"bucket {position}", bucket.nbytes(), bucket.work)

    def _finish(self, complete):
        """End of a synced backward: wait for every bucket, hand the averages to .grad.

        Waiting comes before anyone reads .grad: the optimizer must step with the average,
        not with this rank's half-reduced buffer.
        """
        self._backwards += 1
        with self.timeline.span("compute", "blocked: wait for buckets", blocked=True) \
                if self.timeline else contextlib.nullcontext():
            self._finish_buckets(complete)

    def _finish_buckets(self, complete):
        if not complete and not self.find_unused_parameters:
            for bucket in self.buckets:  # a backward that missed a parameter: only wait, reset
                if hasattr(bucket.work, "wait"):
                    bucket.work.wait()
            self._reset()
            return
        used = None
        for position, bucket in enumerate(self.buckets):
            result = self._wait(position, bucket)
            if result.is_sparse:
                # The all_reduce summed the sparse .grad in place, coalesced (duplicate rows
                # added up). Alone (world size 1) it has no all_reduce: coalesce it here, or
                # the optimizer would add duplicate rows one by one and round otherwise.
                if not result.is_coalesced():
                    bucket.params[0].grad = result.coalesce()
                continue
            for i, view_in, view_out in zip(bucket.indices, bucket.views, bucket.views_of(result)):
                param = self._params[i]
                if self.find_unused_parameters and not self._used[i]:
                    if used is None:  # the first locally unused one: is it used anywhere?
                        used = self._used_everywhere()  # waits for the reduction
                    if not used[i]:
                        continue  # unused on every rank: .grad stays as it was
                if self.gradient_as_bucket_view:
                    if not aliases(view_in, view_out):
                        view_in.copy_(view_out)  # a hook's result lives in a tensor of its own
                    if param.grad is None:
                        param.grad = view_in
                elif param.grad is None:
                    param.grad = torch.empty_like(param).copy_(view_out)
                else:
                    param.grad.copy_(view_out)
        self._reset()

    def _wait(self, position, bucket):
        if self._comm_hook is None:
            if bucket.work is not None:
                bucket.work.wait()
            return bucket.flat
        return hook_result(self._comm_hook[1], bucket.work, position, bucket.flat)

    def _used_everywhere(self):
        if self.world_size == 1:
            return self._used.tolist()
        self._used_work.wait()
        return self._used_anywhere.tolist()

    def _reset(self):
        if self._used_work is not None:
            self._used_work.wait()  # never leave a collective in flight behind us
            self._used_work = None
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
        self._next_bucket = 0
        self._used.zero_()
        self._unused = []
        if len(self._ready_order) != len(self._params):
            self._ready_order = []  # an incomplete first backward teaches no order
