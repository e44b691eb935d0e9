"""ManualDDP: stock DistributedDataParallel's whole constructor and knobs, on top of BucketedDDP.

    torchrun --nproc_per_node=2 examples/uneven.py --join                     # wraps with this
    pytest tests/test_contract.py tests/test_dropin.py                       # knob by knob

Read minddp/ddp/bucketed.py first: the algorithm is there, and nothing here changes it. This file
is what makes the algorithm a drop-in for `torch.nn.parallel.DistributedDataParallel`:
stock's signature (the same arguments in the same order, refused as stock refuses them,
checks.py) and stock's knobs, each in one method below, each bitwise equal to stock with
the same setting (tests/test_contract.py; what each does: docs/buckets.md).
"""

import functools

import torch
import torch.distributed as dist

from ..ddp.bucketed import BucketedDDP
from .bucket_extras import GradBucket, aliases, assign_buckets_with_sparse, expects_sparse_gradient
from .checks import check_stock_arguments, group_of, refuse_unimplemented, warn_check_reduction
from ..launch.usage_error import UsageError
from .comm_hooks import hook_result
from .join import JoinableDDP, join_forward
from .unused import unused_parameters
from ..ddp.grad_hooks import weakly
from .sp_order import sum_each_backward
from .static_graph import StaticGraphDDP


class ManualDDP(StaticGraphDDP, BucketedDDP, JoinableDDP):
    """Stock DDP's constructor and knobs on BucketedDDP: a drop-in for DistributedDataParallel.

    Collective: call on every rank. The knobs, by stock's names and defaults:
      broadcast_buffers / forward_sync_buffers  rank 0's buffers before each training forward
      gradient_as_bucket_view  .grad *is* the bucket's view: no copy, half the gradient memory
      find_unused_parameters   parameters outside this step's graph: marked ready, a used map
      register_comm_hook(state, hook)  reduce each bucket your own way (comm_hooks.py)
      sparse gradients (nn.Embedding(sparse=True))  each in a bucket of its own, sent sparse
      device_ids / output_device  checked as stock checks them; inputs moved to device_ids[0]
      device_mesh      a 1-D mesh (mesh["dp"] of a larger one): its group, as stock
      init_sync=False  no broadcast at construction;  join()  uneven inputs (join.py)
      static_graph     the buckets rebuilt a step later, as stock's (static_graph.py)
      dim, check_reduction  accepted: they steer nothing minddp does (check_reduction warns)
    Stock's other arguments (mixed_precision, ...) are refused in one line.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 lazy_bucket_allocation=False):
        """Stock DDP's constructor, argument for argument; the knobs in the class docstring."""
        refuse_unimplemented(batched_grad_copy=batched_grad_copy,
                             delay_all_reduce_named_params=delay_all_reduce_named_params,
                             param_to_hook_all_reduce=param_to_hook_all_reduce,
                             mixed_precision=mixed_precision,
                             skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                             bucket_cap_mb_list=bucket_cap_mb_list,
                             lazy_bucket_allocation=lazy_bucket_allocation)
        # Stock (torch 2.13): broadcast_buffers=False skips buffers at construction *and*
        # before each forward; forward_sync_buffers=False only the latter.
        at_init = True if forward_sync_buffers is not None else broadcast_buffers is not False
        self.gradient_as_bucket_view = gradient_as_bucket_view  # read by _build_buckets below
        # Sparse gradients: a bucket each, from the start (bucket_extras.py says why); read
        # by _pack_buckets, which BucketedDDP's constructor calls.
        trained = [p for p in module.parameters() if p.requires_grad]
        self._sparse = {i for i, p in enumerate(trained) if expects_sparse_gradient(module, p)}
        # device_mesh: a 1-D mesh, the dp slice of a larger one (mesh/device_mesh.py): our group
        process_group = group_of(process_group, device_mesh)
        sum_each_backward(module)  # sequence parallel's LayerNorms sum over tp as under stock's
        super().__init__(module, check_stock_arguments(module, device_ids, output_device),
                         at_init, init_sync, process_group, bucket_cap_mb)
        self.broadcast_buffers = (at_init if forward_sync_buffers is None
                                  else forward_sync_buffers)
        self.dim = dim  # stock scatters inputs along dim for multi-device modules only
        warn_check_reduction(check_reduction)  # stock's deprecation warning, as stock gives it
        self._comm_hook = None  # (state, hook)
        self._backwards = 0  # synced backwards so far
        JoinableDDP.__init__(self)  # join(): disabled until the context manager enables it
        if static_graph:
            self._set_static_graph()
        self._divide_by_initial_world_size = True
        self._still_training = None  # join(): step 1's work, then the count it summed
        self.find_unused_parameters = find_unused_parameters
        self._unused = []  # find_unused_parameters: indices outside this forward's graph
        self._used = torch.zeros(len(self._params), dtype=torch.int32)  # used here, this step
        self._used_work = None  # the used map's all_reduce, in flight
        if find_unused_parameters:
            # Which parameters take part may change every step, so one step's arrival order
            # says little about the next: stock sizes the buckets once, last parameters
            # first, and never rebuilds them.
            self._build_buckets(self._pack_buckets(self.size_limits)[::-1])
            self._rebuilt = True
            for i, p in enumerate(self._params):  # after BucketedDDP's hook on p, in no_sync too
                p.register_post_accumulate_grad_hook(functools.partial(weakly(self._used_now), i))

    def _pack_buckets(self, size_limits, order=None):
        return assign_buckets_with_sparse(self._params, size_limits, order, sparse=self._sparse)

    def _build_buckets(self, layout):
        super()._build_buckets(layout)
        for i, (_, view) in self._where.items():
            p = self._params[i]
            if self.gradient_as_bucket_view and p.grad is not None and not aliases(p.grad, view):
                p.grad = view.copy_(p.grad)  # after a rebuild, .grad moves into its new bucket

    # --- register_comm_hook: a bucket reduced by your function instead of all_reduce ---

    def register_comm_hook(self, state, hook):
        """Reduce each bucket with hook(state, bucket) -> Future[Tensor], stock's signature.

        The hook gets the bucket's buffer undivided: averaging is its job (comm_hooks.py).
        """
        if self._comm_hook is not None:
            raise UsageError("register_comm_hook can only be called once",
                             hint="register one hook; to combine two, write one that calls both")
        if self._backwards:
            raise UsageError("register_comm_hook after training started",
                             hint="register the hook right after wrapping the model,"
                                  " before any backward")
        self._comm_hook = (state, hook)

    def _reduce_bucket(self, bucket, position):
        if self._comm_hook is None:
            work = super()._reduce_bucket(bucket, position)
        else:
            state, hook = self._comm_hook
            work = hook(state, GradBucket(bucket, position, len(self.buckets)))
        if position == len(self.buckets) - 1 and self.find_unused_parameters:
            self._reduce_used_map()  # the last bucket is on its way: who used what?
        return work

    def _wait_for_bucket(self, bucket, position):
        if self._comm_hook is None:
            return super()._wait_for_bucket(bucket, position)
        return hook_result(self._comm_hook[1], bucket.work, position, bucket.flat)

    # --- gradient_as_bucket_view, sparse gradients, hooks: how a gradient enters its bucket ---

    def _copy_into_bucket(self, index, view):
        bucket, _ = self._where[index]
        param, divide = self._params[index], self._comm_hook is None  # a hook divides itself
        grad = param.grad
        if grad is None and index in self._sparse:
            raise UsageError(f"parameter {self._names[index]!r} expects a sparse gradient"
                             f" but got none on this rank: a sparse bucket has nothing to send",
                             hint="use the embedding on every rank in every step (stock DDP"
                                  " raises 'Expected sparse gradient to be defined')")
        if grad is None:
            view.zero_()  # unused on this rank (find_unused_parameters): it adds nothing
        elif grad.is_sparse:
            # A sparse bucket is its one gradient, sent as it is (gloo sums sparse tensors),
            # divided in place first, as stock divides it.
            bucket.flat = grad.div_(self._divisor()) if divide else grad
        elif aliases(grad, view):  # gradient_as_bucket_view: autograd added into the bucket
            if divide:
                view.div_(self._divisor())
        else:
            if divide:  # grad / world_size, into the view (as bucketed.py, join()'s divisor)
                torch.mul(grad, 1.0 / self._divisor(), out=view)
            else:
                view.copy_(grad)  # a hook gets the sum's addends whole
            if self.gradient_as_bucket_view:
                param.grad = view  # from now on .grad is the bucket: no copy back later

    # --- find_unused_parameters: who took part in this step ---

    # torch.compile(ManualDDP(m)) runs this forward eagerly, as it runs stock DDP's on the
    # CPU: the same numbers as stock in that order, and no graph breaks in the hooks'
    # bookkeeping (docs/dropin.md). ManualDDP(torch.compile(m)) still compiles m.
    @torch._dynamo.disable
    def forward(self, *args, **kwargs):
        """BucketedDDP's forward, inside join() and with find_unused_parameters as stock."""
        if self._join_config.enable:  # inside join(): the collectives the joined ranks answer
            self._still_training = join_forward(self)
            self.require_forward_param_sync = False  # buffers synced there, from the right rank
        output = super().forward(*args, **kwargs)
        if self.find_unused_parameters and torch.is_grad_enabled() and self._sync_this_backward:
            self._unused = unused_parameters(output, self._params)
        return output

    def _used_now(self, index, param):
        if param.grad is not None:
            self._used[index] = 1  # used here: in no_sync() too, it counts for the next sync
        # The parameters outside this step's graph get no hook: they are ready (with a
        # zero contribution) as soon as backward starts, so their buckets can leave.
        unused, self._unused = self._unused, []
        for i in unused:
            self._mark_ready(i)

    def _end_of_backward(self):
        if self.find_unused_parameters:
            # Reached by forward's output but not by this loss: autograd runs no hook for
            # them. Stock passes the outputs through one node (_DDPSink), so its C++ hooks
            # fire with no gradient: ready, adding zero. Here: ready now, buckets in order.
            for i in range(len(self._params)):
                if i not in self._ready:
                    self._mark_ready(i)
        super()._end_of_backward()

    def _reduce_used_map(self):
        if self.world_size > 1:
            # Which parameters did *any* rank use? One unused everywhere keeps its .grad
            # untouched (None stays None); used somewhere, it gets the average.
            self._used_anywhere = self._used.clone()  # reduced in flight; _used stays local
            self._used_work = dist.all_reduce(self._used_anywhere, group=self.process_group,
                                              async_op=True)

    # --- the end of backward: the averages back into .grad, as each knob wants them ---

    def _copy_out_of_bucket(self, bucket, flat):
        if flat.is_sparse:
            # The all_reduce summed the sparse .grad in place, coalesced (duplicate rows
            # added up). Alone (world size 1) nothing coalesced it: do it here, or the
            # optimizer would add duplicate rows one by one and round otherwise.
            if not flat.is_coalesced():
                bucket.params[0].grad = flat.coalesce()
            return
        for i, view, average in zip(bucket.indices, bucket.views, bucket.views_of(flat)):
            param = self._params[i]
            if self.find_unused_parameters and not self._used[i]:
                if not self._used_anywhere_list()[i]:
                    continue  # unused on every rank: .grad stays as it was
            if self.gradient_as_bucket_view:
                if not aliases(view, average):
                    view.copy_(average)  # a hook's result lives in a tensor of its own
                if param.grad is None:
                    param.grad = view
            elif param.grad is None:
                param.grad = torch.empty_like(param).copy_(average)
            else:
                param.grad.copy_(average)

    def _used_anywhere_list(self):
        if self._used_work is not None:  # the first locally unused parameter: wait once
            self._used_work.wait()
            self._used_work = None
            self._used_anywhere = self._used_anywhere.tolist()
        if self.world_size == 1:
            return self._used.tolist()
        return self._used_anywhere

    def _reset(self):
        if self._used_work is not None:
            self._used_work.wait()  # never leave a collective in flight behind us
            self._used_work = None
        super()._reset()
        self._backwards += 1  # (register_comm_hook refuses to come after the first)
        self._still_training = None
        self._used.zero_()
        self._unused = []
