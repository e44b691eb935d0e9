"""The exercises: for each, a lesson, the functions a student writes again, a TODO for each.

    minddp exercise --list                  # the exercises, one line each (writer.py)
    minddp grade exercises/naive.py         # grade.py reads the exercise's world sizes here

Each exercise names a lesson file and the functions (or methods) that carry its idea, what
each one's body must do (the TODO a starting file says), the names a student's file must
define, the world sizes graded by default and those its checks are written for.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    lesson: str  # the lesson module under minddp: "ddp.naive" is minddp/ddp/naive.py
    against: str  # what the grader compares with
    todo: dict  # "Class.method" or "function" -> what its body must do
    names: tuple  # what the student's file must define (classes, functions)
    ranks: tuple  # the world sizes graded by default
    allowed: tuple  # the world sizes the checks are written for

    @property
    def path(self):
        """The lesson file, under minddp/: "ddp/naive.py", "collectives/ring_reduce_scatter.py"."""
        return self.lesson.replace(".", "/") + ".py"


EXERCISES = {
    "sampler": Exercise("ddp.sampler", "torch.utils.data.distributed.DistributedSampler", {
        "ShardSampler.__iter__": "iterate over this rank's indices of the epoch: all indices"
        " in order, or shuffled by torch.randperm with a generator seeded with seed + epoch;"
        " padded to total_size by cycling from the start (or cut to it, with drop_last); then"
        " the positions rank, rank + num_replicas, rank + 2 * num_replicas, ..."},
        ("ShardSampler",), (1, 2, 3, 4, 5), (1, 2, 3, 4, 5, 6, 7, 8)),
    "broadcast": Exercise("ddp.broadcast", "rank src's own tensors", {
        "broadcast_parameters": "copy group rank src's value into every parameter (and every"
        " buffer, if buffers) on every rank, in place; src is a rank of the group: send and"
        " receive with its global rank (groups.global_rank)"},
        ("broadcast_parameters",), (2, 3), (2, 3, 4)),
    "naive": Exercise("ddp.naive", "torch.nn.parallel.DistributedDataParallel", {
        "NaiveDDP._average_gradient": "when a parameter's gradient is complete (and this"
        " backward syncs), replace param.grad by its mean over the ranks, in place: scale by"
        " 1.0 / world_size (multiply: stock's bits; dividing is right too and rounds apart"
        " at 3 ranks), then all_reduce (SUM); register the end-of-backward check on the"
        " first gradient and note each parameter that arrived"},
        ("NaiveDDP",), (1, 2, 3), (1, 2, 3, 4)),
    "bucketed": Exercise("ddp.bucketed", "torch.nn.parallel.DistributedDataParallel", {
        "BucketedDDP._mark_ready": "note the gradient ready, copy it into its bucket, and"
        " launch every bucket that is now complete, strictly in bucket order",
        "BucketedDDP._copy_into_bucket": "copy the parameter's gradient, scaled by 1.0 /"
        " world_size, into its view of the bucket (one pass; multiply, as stock: dividing is"
        " right too and rounds apart at 3 ranks)",
        "BucketedDDP._end_of_backward": "wait for every bucket's all_reduce, then copy each"
        " average back into its parameter's .grad; reset; raise for gradients that never came"},
        ("BucketedDDP",), (1, 2, 3), (1, 2, 3, 4)),
    "zero": Exercise("zero.optimizer", "torch.distributed.optim.ZeroRedundancyOptimizer", {
        "ShardedOptimizer._shards": "split each param group over the ranks, stock's way:"
        " parameters largest first, each to the rank holding the fewest elements so far (the"
        " counts carried from one param group to the next, not restarted)",
        "ShardedOptimizer.step": "step the inner optimizer (this rank's shard), then broadcast"
        " every parameter from the rank that owns it"},
        ("ShardedOptimizer",), (1, 2, 3), (1, 2, 3, 4)),
    "fsdp": Exercise("fsdp.shard", "torch.distributed.fsdp.fully_shard", {
        "Unit.unshard": "all_gather the unit's blocks (one flat buffer, each block padded to"
        " the same rows) into the whole weights, and show them to the module",
        "Unit.reduce_scatter": "sum each whole gradient over the ranks and keep this rank's"
        " rows, averaged, as DTensor blocks. For stock's bits: one flat buffer laid out as"
        " unshard's (row r holds every parameter's block r, padded) and one reduce_scatter"
        " with AVG (gloo sums, then divides); another right way is graded `correct`"},
        ("Unit", "fully_shard"), (1, 2, 3), (1, 2, 3, 4)),
    "tp": Exercise("tp.parallel", "torch.distributed.tensor.parallel.parallelize_module", {
        "ColwiseParallel._whole": "the input every rank's column slice needs, whole, its"
        " gradient summed over the ranks in backward exactly once; three cases: with"
        " self.sequence_dim set (input_layouts=Shard(1)), each rank's slice of the sequence"
        " gathered whole (gather_sequence: its backward sums); an input already gathered by"
        " a PrepareModuleInput around this layer (region is not None and region.gave(name,"
        " x)), as it is (that gather's backward sums its gradient: copy_to_ranks would sum it"
        " twice); else the whole input every rank holds, through copy_to_ranks (its backward"
        " sums)",
        "RowwiseParallel._forward": "this rank's partial output from its weight's columns and"
        " its share of the bias, then summed over the ranks (sum_over_ranks); with"
        " self.sequence_dim set (output_layouts=Shard(1)), reduce_scattered along it instead,"
        " each rank keeping its slice (scatter_sequence)"},
        ("ColwiseParallel", "RowwiseParallel", "parallelize_module"), (2,), (1, 2, 4)),
    "pp": Exercise("pp.schedules", "torch.distributed.pipelining.Schedule1F1B", {
        "one_f_one_b": "the list of (\"F\", i) and (\"B\", i) actions of stage stage_index:"
        " a warm-up of forwards, then one backward and one forward in turn, then the"
        " backwards left"},
        ("one_f_one_b",), (2, 3, 4), (2, 3, 4)),
    "interleaved": Exercise("pp.interleaved",
                            "torch.distributed.pipelining.ScheduleInterleaved1F1B and"
                            " ScheduleInterleavedZeroBubble", {
        "interleaved_1f1b": "rank `rank`'s list of actions \"sFi\" (stage s, F or B, microbatch"
        " i; None slots, the waits, are allowed anywhere and not graded), its stages rank,"
        " rank + pp, ...: per_round = rounds(pp, n) (n // max(1, n // pp)); warmup ="
        " min((n_local - 1) * per_round + 2 * (pp - 1 - rank), n * n_local) forwards; the"
        " op-th forward (op = 0, 1, ... n * n_local - 1) at local stage (op // per_round) %"
        " n_local, stage local * pp + rank; then for op = warmup ... warmup + n * n_local - 1:"
        " the forward op (while op < n * n_local), then a backward at local stage n_local - 1"
        " - ((op - warmup) // per_round) % n_local; each stage numbers its own forwards 0, 1,"
        " ... and its own backwards 0, 1, .... zero_bubble=True: 1 per hop, not 2, in the"
        " warm-up; each B written I (the input's gradient); after the I of op, once op -"
        " warmup >= rank, a W (the weights' gradient) of the oldest I without its W (same"
        " stage and microbatch); at the end the Ws left, in the I's order"},
        ("interleaved_1f1b",), (2, 3, 4), (2, 3, 4)),
    "zero_bubble": Exercise("pp.zero_bubble",
                            "torch.distributed.pipelining.ScheduleInterleavedZeroBubble", {
        "add_bubbles": "stock's _add_bubbles_to_actions: a new list per rank, built a slot at"
        " a time while some rank's list is not used up; in each slot, rank 0 first, each such"
        " rank takes its next action: None is copied (the rank moves on); a forward \"sFi\""
        " with s > 0 whose input \"(s-1)Fi\" was not placed in an EARLIER slot gets None"
        " instead (the rank stays on it); any other action is copied (the rank moves on). What"
        " a slot places counts as done only from the next slot. Actions are never changed or"
        " reordered, only delayed. num_stages is stock's parameter (its own pass checks"
        " more than this rule); the rule never needs it: only a forward ever waits, never an"
        " I, a W or a B"},
        ("add_bubbles",), (2, 3, 4), (2, 3, 4)),
    "ring": Exercise("collectives.ring_reduce_scatter",
                     "torch.distributed.all_reduce and reduce_scatter_tensor (gloo)", {
        "ring_reduce_scatter": "W - 1 steps round the ring: send to rank - 1 the block whose"
        " partial sum you made in the step before (at step 0, your own block rank + 1),"
        " receive from rank + 1 the next one (block rank + step + 2) and combine it into your"
        " own copy of that block, mine <- op(mine, arrived); both at once (p2p.exchange), so"
        " that rank b ends with block b reduced, x_b + (x_{b+1} + (... + x_{b-1}))"},
        ("ring_reduce_scatter",), (2, 3), (2, 3, 4)),
    "recompute": Exercise("memory.recompute",
                          "torch.utils.checkpoint.checkpoint (use_reentrant=False)", {
        "checkpoint": "run function(*args, **kwargs) under saved-tensor hooks"
        " (torch.autograd.graph.saved_tensors_hooks(pack, unpack)): pack replaces each tensor"
        " an op saves by its number; the first unpack of a backward runs the function again"
        " on the arguments cut from the graph (_cut), with the random state saved before the"
        " forward put back (unless preserve_rng_state=False) and the autocast state of the"
        " forward, inside torch.random.fork_rng so that the RNG after is as before (only when"
        " preserve_rng_state: without it, stock leaves the RNG where the run's draws left it); it"
        " collects the tensors that run saves, in order (raise _Stop after the last), and"
        " answers each number with its tensor, once. Refuse an argument changed in place"
        " since the forward (its _version moved): raise RuntimeError in the recompute, as"
        " stock's autograd does. Selective (save_ops): the forward under"
        " Keep(kept, save_ops), the second under Reuse(kept, save_ops)"},
        ("checkpoint",), (1,), (1, 2, 3, 4)),
    "mesh": Exercise("mesh.device_mesh", "torch.distributed.device_mesh.init_device_mesh", {
        "grid_groups": "the groups along dimension dim of a row-major grid of ranks"
        " (torch.arange(prod(shape)).reshape(shape)): one per choice of the other"
        " coordinates, each the global ranks that differ only in coordinate dim, in order"
        " along dim: a list of lists of ints, the groups in any order (every rank makes them"
        " alike)",
        "grid_coordinate": "rank's index along each dimension of the row-major grid (the last"
        " dimension varies fastest): a list of ints, one per dimension"},
        ("grid_groups", "grid_coordinate", "DeviceMesh"), (2, 4), (1, 2, 3, 4)),
    "experts": Exercise("ep.parallel", "one process on the whole batch"
                        " (minddp/references/moe.py)", {
        "_AllToAll.backward": "the gradient of each row that arrived goes back to the rank it"
        " came from, in its place: the same all_to_all_single the other way (send and recv"
        " swapped); None for send, recv and group",
        "ExpertsOnRanks.forward": "(1) all_to_all the counts: each rank's counts cut in runs of"
        " per_rank, one run to each ep rank, so that rows[j][e] is how many rows rank j sends to"
        " my expert e; send[j] = my counts for rank j's experts, recv[j] = what rank j sends me"
        " (dist.all_to_all_single's split sizes count rows, slices along dim 0, never elements;"
        " none given: equal splits); (2) all_to_all the rows with those uneven splits (they"
        " arrive source-major: rank 0's run for my experts, then rank 1's); (3) regroup them"
        " by expert, keeping source order within"
        " an expert (a stable sort): each expert must see its rows in the order (source rank,"
        " token), the order one process on the whole batch gives it, or its gradient is summed in"
        " another order; (4) each local expert on its run; (5) the outputs back to source order"
        " (the inverse permutation), and home by all_to_all (recv and send swapped)",
        "sync_gradients": "the replicated weights' gradients (the router): all_reduce (SUM)"
        " over every rank, then / W; an expert's: all_reduce over the ranks that hold the same"
        " experts (mesh[\"dp\"]; none with a 1-D mesh, never the ep ranks: they hold other"
        " experts), then / W as well (not / dp): the loss is the mean of the W ranks' losses,"
        " and the all_to_all's backward already brought every rank's tokens' part"},
        ("ExpertsOnRanks", "expert_parallel", "sync_gradients"), (2, 4), (1, 2, 4)),
    "clip": Exercise("mesh.clip", "torchtitan's clip_grad_norm_ on stock's fully_shard, TP,"
                     " DDP and pipeline (references/libraries.py)", {
        "_whole": "the norm of the whole from each rank's norm of its part: square it,"
        " all_reduce (SUM) over the group, then the square root ((sum of squares) ** 0.5)",
        "weight_norms": "for each parameter with a gradient, once (a tied weight once), in"
        " module.modules() order: torch.linalg.vector_norm of this rank's gradient (its"
        " to_local() if a DTensor); made whole (_whole) over dp's group, mesh[\"dp\"]"
        ".get_group(), if it is fully_shard's block (a DTensor gradient), then over tp's,"
        " mesh[\"tp\"].get_group(), if it is a TP slice (SLICES[layer] names the attribute);"
        " a copy (DDP's replica over dp, a weight TP leaves whole) as it is; the norms grouped"
        " as stock's meshes: \"tp layers\" (the layers in SLICES) and \"others\", a group"
        " with no norm left out (torch.stack of none fails). Only clip_grad_norm_'s total and"
        " gradients are graded: the keys are yours",
        "clip_grad_norm_": "each group's total: vector_norm of its norms stacked; the total:"
        " the groups' totals squared, summed (from torch.zeros(())), then ** 0.5; with pp:"
        " squared, all_reduce over pp, ** 0.5; then every gradient multiplied by max_norm /"
        " (total + 1e-6) clamped to 1.0, one gradient at a time (torch.nn.utils"
        ".clip_grads_with_norm_ with foreach=False does this: it takes the parameters, and"
        " scales their .grad); return the total (before clipping). Stock's bits come from"
        " stock's order; a total or a scale a rounding apart (another order of the sums, the"
        " scale a Python float) is graded correct, within a stated bound"},
        ("weight_norms", "clip_grad_norm_"), (2, 4), (2, 4)),
    "ring_attention": Exercise("cp.ring_attention", "stock's ring attention"
                               " (torch.distributed.tensor.experimental._context_parallel)", {
        "chunk_ids": "the chunks of the sequence this rank holds, in order: in order, chunk"
        " rank of world_size; zig-zag, of 2 * world_size chunks, rank and its mirror from the"
        " end, 2 * world_size - 1 - rank (stock's head-tail load balancer)",
        "part_of_block": "what rank `rank`'s queries compute against the keys of rank"
        " `source`: (rows, cols, causal), rows and cols Python slices (slice(start, stop), not"
        " lists of indices) of this rank's `length` positions, or None for nothing: the rows"
        " that see any of its keys, the keys those rows see, causal=True only"
        " where that block is not whole (the diagonal block s = r). No mask: everything. In"
        " order: an earlier rank's keys whole, a later one's none. Zig-zag (an early and a late"
        " chunk each): an earlier rank's early chunk for all my rows; a later rank's keys,"
        " whole, for my late chunk only",
        "ring_forward": "size steps round the ring: before computing, pass the k and v block"
        " held (one message, torch.cat of both flattened; pass_on with tag KV) on to the next"
        " rank; at step i compute part_of_block(rank, (rank - i) % size, ...) of it (step 0:"
        " this rank's own block, the diagonal one, always first) with the"
        " kernel (KERNELS[kernel][0]), its out and lse in float32 (lse with a trailing"
        " dimension of 1); the first step starts (out, lse), each later one merges into the"
        " rows it covers (blockwise.merge: stock's sigmoid and logsigmoid form); wait for the"
        " next block. Return out in q's dtype and lse without the trailing dimension, in"
        " torch.promote_types(q.dtype, torch.float32)"},
        ("chunk_ids", "part_of_block", "ring_forward"), (2, 4), (2, 3, 4)),
}
