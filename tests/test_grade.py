"""The exercises and the grader (minddp/grader/writer.py, grade.py): planted mistakes, named.

    pytest tests/test_grade.py

On the shared 2-rank spawn, every exercise's checks run on the lesson file itself (every
check passes), on the starting file `minddp exercise` writes (not written yet, named), and
on at least three wrong solutions per exercise, each a small edit of the lesson: each must
fail with its own diagnosis; and on right solutions written from the TODOs alone, not as
the lesson writes them (tests/corpus.py): each must pass. Then `minddp grade` as a student
runs it: the lesson passes and exits 0; a planted mistake exits 1 with its diagnosis, also
as JSON; an exception is reported at its line in the student's file; a collective that
never completes, with the collective each rank was in; a file or a flag the grader cannot
use is one line, exit 2.
"""

import contextlib
import gc
import json
import pathlib
import re
import sys
import tempfile

import pytest

from ahead import ahead_run
from helpers import REPO, cli, run, share_spawn, shared_results
from corpus import RIGHT
from corpus_wrong import WRONG
from minddp.grader.exercises import EXERCISES
from minddp.grader.writer import solution, starting_file
from minddp.grader.student import load
# (imported here, before the spawned ranks start their group: the checks import
# torch.distributed.optim, which imported after init_process_group keeps the group alive)
from minddp.grader.checks import CHECKS

# exercise -> [(mistake, lesson text, replaced by, what the diagnosis must say)]
PLANTED = {
    "sampler": [
        ("set_epoch ignored", "g.manual_seed(self.seed + self.epoch)", "g.manual_seed(self.seed)",
         "the same order every epoch"),
        ("shuffle=False ignored", "        if self.shuffle:\n", "        if True:\n",
         "in another order: shuffle=False keeps 0 .. n-1 in order"),
        ("padded from the end", "order = [order[i % n] for i in range(self.total_size)]",
         "order = (order + order[::-1] * self.total_size)[:self.total_size]",
         "the order is stock's, what pads it is not"),
        ("a block per rank", "return iter(order[self.rank::self.num_replicas])",
         "return iter(order[self.rank * self.num_samples:][:self.num_samples])",
         "the same indices, dealt to other ranks"),
        ("no padding", "order = [order[i % n] for i in range(self.total_size)]",
         "order = order[:self.total_size]", "every rank must get as many"),
        ("the global generator reseeded", "            g = torch.Generator()\n"
         "            g.manual_seed(self.seed + self.epoch)\n",
         "            g = torch.manual_seed(self.seed + self.epoch)\n",
         "moved or reset torch's global random state"),
    ],
    "broadcast": [
        ("frozen parameters skipped", "    tensors = list(module.named_parameters()) + (list(",
         "    tensors = [(n, p) for n, p in module.named_parameters() if p.requires_grad] + (list(",
         "still holds its own 0.bias: nothing was copied into it, in place (the optimizer"
         " holds these very tensors) (a frozen parameter too)"),
        ("buffers skipped", "(list(module.named_buffers()) if buffers else [])", "[]",
         "still holds its own 1.running_mean"),
        ("always the last rank", "dist.broadcast(tensor, src=global_rank(group, src)",
         "dist.broadcast(tensor, src=global_rank(group, dist.get_world_size(group) - 1)",
         "holds rank 1's"),
        ("not in place", "dist.broadcast(tensor, src", "dist.broadcast(tensor.clone(), src",
         "nothing was copied into it, in place"),
    ],
    "naive": [
        ("a sum, not a mean", "grad.mul_(1.0 / self.world_size)", "pass",
         "2.000x stock's, every gradient: summed, not averaged"),
        ("no all_reduce", "chosen.all_reduce(grad, op=dist.ReduceOp.SUM,"
         " group=self.process_group)",
         "pass", "the average was skipped"),
        ("no broadcast", "broadcast_parameters(module, src=0, group=process_group,"
         " buffers=broadcast_buffers)", "pass", "ranks start from different weights"),
        ("divided twice", "grad.mul_(1.0 / self.world_size)",
         "grad.mul_(1.0 / self.world_size ** 2)", "0.500x stock's, every gradient: averaged"),
        ("no_sync() ignored", "        self.require_backward_grad_sync = False\n", "",
         "a backward inside no_sync() communicated"),
    ],
    "bucketed": [
        ("not divided", "torch.mul(grad, 1.0 / self.world_size, out=view)", "view.copy_(grad)",
         "summed, not averaged"),
        ("averages not copied back", "self._copy_out_of_bucket(bucket, flat)", "pass",
         "the average was skipped"),
        ("divided twice", "torch.mul(grad, 1.0 / self.world_size, out=view)",
         "torch.mul(grad, 1.0 / self.world_size ** 2, out=view)", "averaged twice"),
        ("always the first bucket", "            bucket = self.buckets[self._next_bucket]\n",
         "            bucket = self.buckets[0]\n", "the average was skipped"),
        ("one bucket per gradient at most", "        while (self._next_bucket < len(self.buckets)",
         "        if (self._next_bucket < len(self.buckets)", "a bucket never launched"),
    ],
    "zero": [
        ("sizes counted per group", "        for group in self.param_groups:\n"
         "            mine = [[] for _ in range(self.world_size)]\n",
         "        for group in self.param_groups:\n"
         "            sizes = [0] * self.world_size  # per group: stock counts across groups\n"
         "            mine = [[] for _ in range(self.world_size)]\n",
         "the shards are not stock's"),
        ("no broadcast after the step", "works.append(dist.broadcast(p.data, src=src,"
         " group=self.process_group,\n" + " " * 48 + "async_op=True))", "pass",
         "an updated shard never reached it"),
        ("not sharded", "self.optim = optimizer_cls(self.partition[self.rank], **defaults)",
         "self.optim = optimizer_cls(self.param_groups, **defaults)",
         "every rank keeps state for every parameter"),
        ("round robin", "rank = sizes.index(min(sizes))",
         "rank = sum(map(len, mine)) % self.world_size", "the shards are not stock's"),
    ],
    "fsdp": [
        ("a sum, not an average", "dist.ReduceOp.AVG", "dist.ReduceOp.SUM", "summed, not averaged"),
        ("its own block left out", "piece[:block.numel()].copy_(block.reshape(-1))",
         "piece[:block.numel()].zero_()", "a different gradient"),
        ("no padding", "(0, 0, 0, p.rows * self.world_size - len(g))", "(0, 0, 0, 0)",
         "an exception: RuntimeError"),
        ("nothing reduced", "dist.reduce_scatter_single(mine, flat.view(-1), dist.ReduceOp.AVG,"
         " self.group)", "mine.copy_(flat[self.rank])",
         "rows of the gradient are its own gradient's, not the average"),
        ("the whole weight refilled in place under autograd's eye",
         "for r, block in enumerate(p.full.data.view(-1).split(p.block_numel)):",
         "for r, block in enumerate(p.full.view(-1).split(p.block_numel)):",
         "has been modified by an inplace operation"),
    ],
    "tp": [
        ("the bias on every rank", "share = None if module.bias is None else ShareOfBias.apply(",
         "share = module.bias if True else ShareOfBias.apply(",
         "the output holds the row split's bias 2 times"),
        ("the input's gradient not summed", "return copy_to_ranks(x, group)", "return x",
         "the column split's backward did not sum the ranks' input gradients"),
        ("the outputs not summed", "return sum_over_ranks(partial, group)", "return partial",
         "rank 1's output differs from rank 0's, where stock's is the same on every rank: the"
         " row split's partial outputs were not summed"),
        ("a sum too many with sequence parallelism",
         "            return gather_sequence(x, self.sequence_dim, group)\n",
         "            return copy_to_ranks(gather_sequence(x, self.sequence_dim, group), group)\n",
         "one sum too many over the ranks (copy_to_ranks where gather_sequence's backward"),
        ("the sequence not gathered", "        if self.sequence_dim is not None:\n"
         "            return gather_sequence(x, self.sequence_dim, group)\n", "",
         "the sequence was cut twice"),
        ("the sum not reduce_scattered", "        if self.sequence_dim is not None:\n"
         "            return scatter_sequence(partial, self.sequence_dim, group)\n", "",
         "it holds the whole sequence"),
        ("the whole bias on rank 0 only", "partial = F.linear(x, module.weight, share)",
         "partial = F.linear(x, module.weight, module.bias if dist.get_rank(group) == 0 else"
         " None)", "added on one rank only"),
        ("a bias 2^-20 too large, placed as stock's", "partial = F.linear(x, module.weight, share)",
         "partial = F.linear(x, module.weight, None if share is None else share * (1 + 2 ** -20))",
         "tiny: "),  # a rounding apart, yet not the textbook's placement either: failed
    ],
    "pp": [
        ("a warm-up one short", "warmup = min(n, num_stages - stage_index)",
         "warmup = min(n, num_stages - stage_index - 1)", "the warm-up: stock runs"),
        ("a warm-up one long", "warmup = min(n, num_stages - stage_index)",
         "warmup = min(n, num_stages - stage_index + 1)", "the warm-up: stock runs"),
        ("a backward short", "while backwards < n:", "while backwards < n - 1:",
         "actions missing or repeated"),
        ("F before B in the steady state",
         "        actions.append((\"B\", backwards))\n        backwards += 1\n"
         "        if forwards < n:\n            actions.append((\"F\", forwards))\n"
         "            forwards += 1\n",
         "        if forwards < n:\n            actions.append((\"F\", forwards))\n"
         "            forwards += 1\n        actions.append((\"B\", backwards))\n"
         "        backwards += 1\n",
         "or a steady state that runs F before B"),
    ],
    "interleaved": [
        ("a warm-up one hop too long", "hop * (pp - 1 - rank), n * n_local)",
         "hop * (pp - rank), n * n_local)",
         "the warm-up: stock's rank 1 runs 3 forwards before its first backward, yours 4"),
        ("the forwards one microbatch a stage", "return (op // per_round) % n_local * pp + rank",
         "return op % n_local * pp + rank", "the forwards' stages: stock's forward number 1"),
        ("the backwards from the first stage",
         "return (n_local - 1 - (op - warmup) // per_round % n_local) * pp + rank",
         "return ((op - warmup) // per_round % n_local) * pp + rank",
         "the backwards' stages: stock's backward number 0 runs at stage 2, yours at 0"),
        ("a W after every I", "op - warmup >= rank:", "op - warmup >= 0:",
         "the Ws: stock's rank 1 runs 2 I(s) before its first W, yours 1"),
        ("zero bubble's warm-up 2 a hop", "hop = 1 if zero_bubble else 2", "hop = 2",
         "(yours adds 2 a hop, as interleaved 1F1B; zero bubble adds 1)"),
        ("B before F in the steady state",
         "            actions.append(act(forward_stage(op), \"F\"))\n"
         "        elif not zero_bubble:\n"
         "            actions.append(None)  # the cool-down waits a slot for each gradient\n"
         "        actions.append(act(backward_stage(op), \"I\" if zero_bubble else \"B\"))\n",
         "            actions.append(act(backward_stage(op), \"I\" if zero_bubble else \"B\"))\n"
         "            actions.append(act(forward_stage(op), \"F\"))\n"
         "        else:\n"
         "            actions.append(act(backward_stage(op), \"I\" if zero_bubble else \"B\"))\n",
         "the steady state: stock runs each op's F, then its B (F first)"),
    ],
    "zero_bubble": [
        ("a slot's actions done at once", "                now.add((stage, kind, i))",
         "                done.add((stage, kind, i))",
         "runs in the same slot (on another rank): what a slot places counts as done only from"
         " the next slot"),
        ("the list's own None slots dropped", "            action = actions[at[r]]\n",
         "            action = actions[at[r]]\n            if action is None:  # nothing to run\n"
         "                at[r] += 1\n                continue\n",
         "rank 1's list has a None of its own here"),
        ("a waiting forward lost",
         "                result[r].append(None)  # wait: the activation is not there yet\n",
         "                result[r].append(None)  # wait: the activation is not there yet\n"
         "                at[r] += 1\n",
         "rank 0's list changed: 2F0 (stage 2's forward of microbatch 0) is lost"),
    ],
    "ring": [
        ("a step short", "for step in range(size - 1):", "for step in range(size - 2):",
         "block 0 is still rank 0's own value: it never travelled round the ring"),
        ("copied, not combined", "combine(op, mine, arrived)  #", "mine.copy_(arrived)  #",
         "copied what arrived over this rank's own copy instead of combining the two"),
        ("the op ignored", "combine(op, mine, arrived)  #", "mine.add_(arrived)  #",
         "the ranks' values added, not their MAX"),
    ],
    "recompute": [
        ("the random state not replayed", "            if rng is not None:\n"
         "                torch.set_rng_state(rng)\n", "",
         "the random state was not replayed"),
        ("nothing dropped", "saved_tensors_hooks(pack, unpack)",
         "saved_tensors_hooks(lambda t: t, lambda t: t)", "nothing dropped: yours keeps"),
        ("the RNG left where the second forward put it",
         "with torch.random.fork_rng(devices=cuda, enabled=preserve_rng_state):",
         "with contextlib.nullcontext():", "but not the random state after backward"),
        ("autocast not put back", "enabled=autocast[0]", "enabled=False",
         "under autocast only: the second forward did not run under the first one's autocast"),
        ("the kept outputs not reused", "Reuse(kept, save_ops) if save_ops else"
         " contextlib.nullcontext()", "contextlib.nullcontext()",
         "selective keeps less than stock's"),
    ],
    "mesh": [
        ("the slice, not the line", "lines = ranks.movedim(dim, -1).reshape(-1, shape[dim])",
         "lines = ranks.movedim(dim, 0).reshape(shape[dim], -1)",
         "the ranks that share coordinate 0 (the slice through the grid"),
        ("consecutive ranks", "lines = ranks.movedim(dim, -1).reshape(-1, shape[dim])",
         "lines = ranks.reshape(-1, shape[dim])", "blocks of 2 consecutive ranks"),
        ("moved the wrong way", "lines = ranks.movedim(dim, -1).reshape(-1, shape[dim])",
         "lines = ranks.movedim(-1, dim).reshape(-1, shape[dim])",
         "stock's groups along dimension 1, not 0"),
        ("a coordinate read backwards", "return [int(c) for c in (ranks == rank).nonzero()[0]]",
         "return [int(c) for c in reversed((ranks == rank).nonzero()[0])]",
         "the indices listed last dimension first"),
        ("a column-major coordinate", "return [int(c) for c in (ranks == rank).nonzero()[0]]",
         "return [int(c) for c in (torch.arange(math.prod(shape)).reshape(shape[::-1])"
         ".permute(*reversed(range(len(shape)))) == rank).nonzero()[0]]",
         "column-major: your first dimension varies fastest"),
    ],
    "experts": [
        ("the counts not exchanged", "dist.all_to_all_single(rows, counts, group=self.group)",
         "rows.copy_(counts)", "the counts not exchanged: each rank expects from every rank"
         " what it sends itself"),
        ("source order broken within an expert",
         "by_expert = torch.argsort(experts_of_rows, stable=True)",
         "by_expert = torch.argsort(experts_of_rows * len(experts_of_rows)\n"
         "                                   - torch.arange(len(experts_of_rows)))",
         "expert 2 (on rank 0) got the right 2 rows in another order: its row 0 is rank 1's"
         " row 0 of its 1 for it, one process's is rank 0's row 0 of its 1 for it"),
        ("the rows not regrouped by expert", "runs = arrived[by_expert].split(",
         "runs = arrived.split(", "got other rows than one process's"),
        ("the outputs not back to source order", "back = outputs[torch.argsort(by_expert)]",
         "back = outputs", "every expert was given the reference's rows in the reference's"
         " order, but this rank's outputs are not its pairs'"),
        ("the backward not sent home", "return back, None, None, None",
         "return grad, None, None, None", "the forward is right, the backward returned a"
         " gradient of another number of rows"),
        ("the backward with the forward's splits",
         "dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)",
         "dist.all_to_all_single(back, grad.contiguous(), recv, send, group=group)",
         "the forward is right, the backward is not: the gradients are not sent home"),
        ("the experts not divided", "        p.grad /= world_size  # the loss is the mean",
         "        if id(p) not in experts:\n            p.grad /= world_size  # the loss is the"
         " mean", "2.000x the reference's, expert 2's gradient: not divided by W = 2"),
        ("the experts summed over every rank", "if id(p) not in experts:", "if True:",
         "summed over the ep ranks, which hold other experts"),
        ("the replicated weights not averaged", "dist.all_reduce(p.grad)  # the mesh",
         "pass  # the mesh", "the replicated weights' gradients (router.weight) differ from"
         " rank to rank"),
    ],
    "clip": [
        ("a DDP replica summed over dp", 'if isinstance(p.grad, DTensor) and "dp" in names:',
         'if "dp" in names:', "a copy counted dp times: each gradient is a replica over dp"),
        ("the row split's bias summed over tp", "if tp_layer and attr in SLICES[layer]:",
         "if tp_layer:", "a copy counted tp times: the row split's bias"),
        ("fully_shard's blocks not summed", 'norm = _whole(norm, mesh["dp"].get_group())',
         "norm = norm", "a part not summed over dp"),
        ("the parts' norms added, not their squares", "    norm = norm ** 2\n",
         "    norm = norm.clone()\n", "the squares not taken"),
        ("the parts' sum not rooted", "    return norm ** 0.5\n", "    return norm\n",
         "the sqrt missed"),
        ("the stages not summed", 'if "pp" in mesh.mesh_dim_names:', "if False:",
         "the stages not summed over pp"),
        ("the scale not clamped",
         "torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)",
         "[p.grad.mul_(max_norm / (total + 1e-6)) for p in params]",
         "the scale not clamped to 1"),
        ("the gradients given for the parameters",
         "torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)",
         "torch.nn.utils.clip_grads_with_norm_([p.grad for p in params], max_norm, total,"
         " foreach=False)", "not scaled: the total exceeds max_norm"),
    ],
    "ring_attention": [
        ("zig-zag's second chunk not the mirror", "[rank, 2 * world_size - 1 - rank]",
         "[rank, world_size + rank]", "rank 0 of 2: yours [0, 2], stock's [0, 3]: zig-zag cuts"
         " the sequence in 2 x 2 = 4 chunks"),
        ("the diagonal without its mask", "return whole, whole, True  #",
         "return whole, whole, False  #", "computes pairs the causal mask excludes"),
        ("a later rank's keys for all my rows", "return late, whole, False",
         "return whole, whole, False", "computes pairs the causal mask excludes (8 of them):"
         " the query at position 0 (row 0) sees no key after it"),
        ("a later rank's keys skipped", "return late, whole, False", "return None",
         "skips pairs a query needs"),
        ("each block replaces the one before",
         "merge(out[:, :, rows], lse[:, :, rows],\n" + " " * 57 + "block_out, block_lse)",
         "block_out, block_lse", "each block's result replaces the one before"),
        ("the lse not combined", "out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows],"
         " lse[:, :, rows],\n" + " " * 57 + "block_out, block_lse)",
         "out[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)[0]",
         "the lse not combined"),
        ("merged in bfloat16", "block_out.float(), block_lse.float().unsqueeze(-1)",
         "block_out, block_lse.unsqueeze(-1)", "merged in the input's dtype (bfloat16)"),
        ("the blocks' shares not normalized",
         "merge(out[:, :, rows], lse[:, :, rows],\n" + " " * 57 + "block_out, block_lse)",
         "(torch.exp(lse[:, :, rows]) * out[:, :, rows] + torch.exp(block_lse) * block_out,"
         " torch.logaddexp(lse[:, :, rows], block_lse))",
         "the max (the whole lse) subtracted"),
    ],
}


def _sources():
    """{(exercise, what): source}: the lesson, the starting file, each planted mistake."""
    sources = {}
    for name, exercise in EXERCISES.items():
        lesson = (REPO / "minddp" / exercise.path).read_text()
        sources[name, "the lesson"] = lesson
        sources[name, "the starting file"] = starting_file(name)
        for mistake, old, new, _ in PLANTED[name]:
            assert lesson.count(old) == 1, (name, mistake)  # the edit lands where meant
            sources[name, mistake] = lesson.replace(old, new)
        for label, bodies in RIGHT.get(name, {}).items():  # (tests/corpus.py)
            sources[name, f"right: {label}"] = solution(name, bodies)
    return sources


def _grade(rank, world_size):
    """Every source's checks at this world size: {(exercise, what): results}."""
    return _graded(_sources(), rank, world_size)


def _written_wrong(rank, world_size):
    """tests/corpus_wrong.py's solutions whose mistake shows at this world size, each failing
    alike on every rank: {(exercise, solution): results}."""
    return _graded({(name, label): solution(name, wrong["bodies"])
                    for name, solutions in WRONG.items() for label, wrong in solutions.items()
                    if wrong["ranks"] == world_size and not wrong["alone"]}, rank, world_size)


def _graded(sources, rank, world_size):
    graded = {}
    with tempfile.TemporaryDirectory() as directory:  # this rank's own copies
        for i, ((name, what), source) in enumerate(sorted(sources.items())):
            path = pathlib.Path(directory, f"{i}", f"{name}.py")
            path.parent.mkdir()
            path.write_text(source)
            try:  # every rank raises alike here (a planted mistake's, or a TODO's)
                graded[name, what] = CHECKS[name](
                    load(path, EXERCISES[name].lesson), rank, world_size)
            except Exception as error:
                graded[name, what] = [{"passed": False, "diagnosis": f"an exception:"
                                       f" {type(error).__name__}: {error}"}]
    return graded


def _right_at(rank, world_size):
    """tests/corpus.py's right solutions, each at this world size where its exercise's
    checks are written for it (2 ranks: _grade): {(exercise, solution): results}."""
    return _graded({(name, label): solution(name, bodies) for name, solutions in RIGHT.items()
                    for label, bodies in solutions.items()
                    if world_size in EXERCISES[name].allowed}, rank, world_size)


share_spawn(_grade, [2])
share_spawn(_written_wrong, [1, 2, 3, 4])
share_spawn(_right_at, [1, 3, 4, 5, 6, 7, 8])  # (5 to 8: the sampler's)


def _pairings(rank, world_size):
    """pairing.unpaired on rank 0 sending rank 1 five elements, rank 1 receiving: {case: said}."""
    import torch
    import torch.distributed as dist
    from minddp.grader.ranks.pairing import unpaired

    def talk(received, p2p):
        if rank == 0:
            work = dist.isend(torch.ones(5), 1) if p2p else dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, torch.ones(5), 1)])
        elif received is not None:
            work = dist.irecv(torch.empty(received), 0) if p2p else dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv, torch.empty(received), 0)])
        else:
            work = None
        return work
    said = {(received, p2p): unpaired(lambda: talk(received, p2p), "case")
            for received in (None, 3, 5, 7) for p2p in (True, False)}

    def both(first, wait):  # each rank sends its peer 5 elements and receives 5 from it
        peer, out, into = 1 - rank, torch.ones(5), torch.empty(5)
        if first == "send":  # gloo's send waits for its peer's receive: a deadlock
            dist.send(out, peer)
            dist.recv(into, peer)
        elif first == "isend":  # posted, not waited for: the receive can be posted
            work = dist.isend(out, peer)
            dist.recv(into, peer)
            work.wait()
        else:  # rank 0 sends first, rank 1 receives first: they pair up
            if rank == 0:
                dist.send(out, peer)
                dist.recv(into, peer)
            else:
                dist.recv(into, peer)
                dist.send(out, peer)
    for first in ("send", "isend", "in turn"):
        said[first] = unpaired(lambda: both(first, True), "case")
    return said


share_spawn(_pairings, [2])


def test_sends_and_receives_that_do_not_pair_up_are_found_without_a_message_sent():
    # gloo: a receive larger than its message takes it; smaller aborts; none at all waits
    for said in shared_results(_pairings, 2):
        for p2p in (True, False):
            assert said[5, p2p] is None and said[7, p2p] is None
            where, why = said[3, p2p]
            assert where == ("case, rank 0 -> rank 1: message 0: rank 0 sends 5 elements, rank 1"
                             " posts a receive of 3 elements") and "gloo aborts" in why
            where, why = said[None, p2p]
            assert where.endswith("rank 0 sends 5 elements, rank 1 posts a receive of nothing")
            assert "do not pair up" in why
        # played out as gloo runs them: blocking sends first on both ranks never complete
        where, why = said["send"]
        assert where == ("case: rank 0 waits in its send to rank 1 (message 0 of that link);"
                         " rank 1 waits in its send to rank 0 (message 0 of that link)")
        assert why.startswith("a deadlock: every rank waits in a blocking send"), why
        assert said["isend"] is None and said["in turn"] is None


@pytest.mark.parametrize("name", list(EXERCISES))
def test_every_lesson_passes_its_own_exercise(name):
    for rank, graded in enumerate(shared_results(_grade, 2)):
        results = graded[name, "the lesson"]
        assert results and all(r["passed"] for r in results), (rank, results)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_a_starting_file_is_not_written_yet(name):
    for graded in shared_results(_grade, 2):
        results = graded[name, "the starting file"]
        assert not any(r["passed"] for r in results)
        assert any("NotImplementedError: TODO: " in r["diagnosis"] for r in results), results


@pytest.mark.parametrize("name,label,world_size", [
    (n, label, w) for n, sols in RIGHT.items() for label in sols for w in EXERCISES[n].allowed])
def test_a_right_solution_written_from_the_todos_passes(name, label, world_size):
    # Not the lesson's code, as a student would write it: stock's bits, or `correct`, at
    # every world size the exercise's checks are written for (the sizes `--ranks` accepts).
    found = _grade if world_size == 2 else _right_at
    for rank, graded in enumerate(shared_results(found, world_size)):
        results = graded[name, f"right: {label}" if world_size == 2 else label]
        failed = [r for r in results if not r["passed"]]
        assert results and not failed, (rank, label, failed[:1])
        for r in results:  # `correct` says what differs from stock: never a bare pass
            assert r.get("outcome", "passed") == "passed" or r["diagnosis"].startswith(
                "correct, not "), (rank, label, r)


# Right solutions a rounding apart from stock's: each `correct`, with what differs named
# (tests/corpus.py), where it rounds apart; at the other sizes they pass or are as named.
ROUNDING_APART = [
    ("clip", "clip C", 2, "your scale is a Python float (float64, rounded to float32 once, at"
     " the multiply): 1 unit(s) of the last place from stock's float32 scale"),
    ("clip", "clip C", 4, "your scale is a Python float"),
    ("clip", "clip D", 2, "your total is"),
    ("ring", "ring D", 4, "your ring runs the other way (to rank + 1): block b is added x_b +"
     " (x_(b-1) + (... + x_(b+1))), gloo's x_b + (x_(b+1) + (... + x_(b-1))): the same sums"
     " in another order"),
]


@pytest.mark.parametrize("name,label,world_size,said", ROUNDING_APART)
def test_a_right_solution_a_rounding_apart_is_correct_and_says_what_differs(
        name, label, world_size, said):
    found = _grade if world_size == 2 else _right_at
    for rank, graded in enumerate(shared_results(found, world_size)):
        results = graded[name, f"right: {label}" if world_size == 2 else label]
        correct = [r for r in results if r.get("outcome") == "correct"]
        assert correct and all(r["passed"] for r in results), (rank, label, results)
        assert said in correct[0]["diagnosis"], (rank, correct[0])


@pytest.mark.parametrize("name,qualname,words", [
    ("experts", "ExpertsOnRanks.forward", "split sizes count rows, slices along dim 0"),
    ("clip", "weight_norms", 'mesh["dp"].get_group()'),
    ("clip", "weight_norms", "a group with no norm left out"),
    ("clip", "weight_norms", "the keys are yours"),
    ("clip", "clip_grad_norm_", "a scale a rounding apart"),
    ("zero_bubble", "add_bubbles", "the rule never needs it"),
    ("ring_attention", "part_of_block", "Python slices (slice(start, stop), not lists"),
    ("ring_attention", "ring_forward", "this rank's own block, the diagonal one, always first"),
    ("mesh", "grid_groups", "the groups in any order"),
    ("mesh", "grid_coordinate", "a list of ints, one per dimension"),
    ("recompute", "checkpoint", "raise RuntimeError"),
    ("tp", "ColwiseParallel._whole", "an input already gathered by a PrepareModuleInput"),
])
def test_a_todo_says_what_the_grader_checks(name, qualname, words):
    """What a student cannot tell from the code around a TODO, and the grader checks."""
    todo = EXERCISES[name].todo[qualname]
    assert words in todo, (name, qualname, todo)
    assert words in " ".join(starting_file(name).replace("# ", "").split()), (name, words)


@pytest.mark.parametrize("name,mistake,said", [(n, m, said) for n, cases in PLANTED.items()
                                               for m, _, _, said in cases])
def test_a_planted_mistake_is_named(name, mistake, said):
    for rank, graded in enumerate(shared_results(_grade, 2)):
        failed = [r for r in graded[name, mistake] if not r["passed"]]
        assert failed, (rank, mistake, graded[name, mistake])
        assert said in failed[0]["diagnosis"], (rank, failed[0])


@pytest.mark.parametrize("name,label", [(name, label) for name, solutions in WRONG.items()
                                         for label, wrong in solutions.items()
                                         if not wrong["alone"]])
def test_a_wrong_solution_written_from_the_todos_fails_saying_what(name, label):
    # tests/corpus_wrong.py: at the world size its mistake shows at
    wrong = WRONG[name][label]
    for rank, graded in enumerate(shared_results(_written_wrong, wrong["ranks"])):
        failed = [r for r in graded[name, label] if not r["passed"]]
        assert failed, (rank, label, "passed every check")
        assert wrong["said"] in failed[0]["diagnosis"], (rank, label, failed[0])


@pytest.mark.parametrize("name", sorted({name for name, solutions in WRONG.items()
                                         for wrong in solutions.values() if wrong["alone"]}))
def test_a_wrong_solution_that_raises_on_some_ranks_or_hangs_fails_saying_what(tmp_path, name):
    # Graded as a teacher grades a folder, one command per world size, at the default
    # --timeout: a hang is named when the ranks' calls show it can never complete (two
    # ranks inside one call of a group, called unlike), not when a time runs out, so that a
    # loaded machine never reads as a hang, nor a slow rank as one (fsdp's: 15 runs beside
    # two busy loops and 5 beside six, all green; with `--timeout 3` it failed once loaded).
    groups = {}
    for label, wrong in WRONG[name].items():
        if wrong["alone"]:
            folder = tmp_path / f"{wrong['ranks']}"
            folder.mkdir(exist_ok=True)
            (folder / f"{label}.py").write_text(solution(name, wrong["bodies"]))
            groups[folder] = wrong["ranks"]
    for folder, ranks in groups.items():
        result = cli("grade", folder, "--exercise", name, "--ranks", ranks, "--json")
        assert result.stdout.startswith("{"), result.stderr[-3000:]  # the grader's own error
        for graded in json.loads(result.stdout)["files"]:
            label = pathlib.Path(graded["file"]).stem
            failed = [c for c in graded["checks"] if not c["passed"]]
            assert failed, (label, "passed every check")
            assert WRONG[name][label]["said"] in failed[0]["diagnosis"], (label, failed[0])


def _planted(tmp_path, name, mistake, folder="planted"):
    """The lesson with one planted mistake, written as a student's file."""
    exercise = EXERCISES[name]
    old, new = next((o, n) for m, o, n, _ in PLANTED[name] if m == mistake)
    path = tmp_path / folder / f"{name}.py"
    path.parent.mkdir()
    path.write_text((REPO / "minddp" / exercise.path).read_text().replace(old, new))
    return path


AS_A_STUDENT = ahead_run([sys.executable, "-m", "minddp", "grade", "minddp/ddp/naive.py"])


def test_grading_a_lesson_as_a_student_does_passes_and_exits_0():
    result = AS_A_STUDENT.result()
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == (
        "graded minddp/ddp/naive.py: exercise 'naive' (minddp/ddp/naive.py) against"
        " torch.nn.parallel.DistributedDataParallel")
    assert "  2 ranks, the toy model, SGD: passed" in result.stdout
    # at 3 ranks one all_reduce per parameter adds in another order than stock's buckets:
    # right, within the rounding bound, not stock's bits; the subgroup check passes
    assert "  3 ranks, the toy model, process_group = ranks 1..2: passed" in result.stdout
    assert result.stdout.splitlines()[-1] == ("verdict: 13 of 13 checks passed (3 correct, not"
                                              " stock's bits)")


def test_a_planted_mistake_exits_1_with_its_diagnosis_also_as_json(tmp_path):
    path = _planted(tmp_path, "naive", "a sum, not a mean")
    result = cli("grade", str(path), "--ranks", "2", "--json")
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["exercise"] == "naive" and report["passed"] is False
    first = report["checks"][0]
    assert first["where"].startswith("step 0, rank 0, layers.0.weight, element (0, 0): yours")
    assert first["diagnosis"] == ("2.000x stock's, every gradient: summed, not averaged: divide"
                                  " by the world size, 2")


def test_an_exception_is_reported_at_its_line_in_the_students_file(tmp_path):
    # broadcast with src taken as a global rank: on a group without rank 0, torch refuses
    path = tmp_path / "broadcast.py"
    path.write_text((REPO / "minddp" / "ddp" / "broadcast.py").read_text().replace(
        "dist.broadcast(tensor, src=global_rank(group, src)", "dist.broadcast(tensor, src=src"))
    result = cli("grade", str(path), "--ranks", "3")
    assert result.returncode == 1, result.stderr[-2000:]
    line = path.read_text().splitlines().index(
        "        dist.broadcast(tensor, src=src, group=group)") + 1
    assert re.search(rf"      at:        rank [12], broadcast.py line {line}: dist.broadcast"
                     r"\(tensor, src=src, group=group\)", result.stdout), result.stdout
    assert "      diagnosis: an exception: ValueError: Global rank 0 is not part of group" \
        in result.stdout, result.stdout


def _naive_before_its_all_reduce(tmp_path, lines):
    """naive.py with `lines` in place of the test before its all_reduce, as a student's file."""
    path = tmp_path / "naive.py"
    path.write_text((REPO / "minddp" / "ddp" / "naive.py").read_text().replace(
        "        if self.world_size > 1:\n            # Blocking", lines + "            # Blocking"))
    return path


def test_a_collective_that_never_completes_names_where_each_rank_waits(tmp_path):
    path = _naive_before_its_all_reduce(
        tmp_path, "        if self.world_size > 1 and dist.get_rank() == 1:  # rank 1 only\n")
    # (the default --timeout: the hang is named as soon as every rank is inside a call of
    # the world that can never complete, rank 0 in the grader's gathering, rank 1 in its
    # all_reduce: the same call of the group, another collective)
    result = cli("grade", str(path), "--ranks", "2", "3", "4")
    assert result.returncode == 1, result.stderr[-2000:]
    line = path.read_text().splitlines().index(
        "            chosen.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.process_group)") + 1
    assert f"rank 1 waits in all_reduce (naive.py line {line})" in result.stdout, result.stdout
    assert result.stdout.count("diagnosis: a collective that can never complete") == 1
    # one --timeout for the whole grade: the world sizes after a hang are not run
    assert "  3, 4 ranks: not run: FAILED" in result.stdout, result.stdout
    assert "diagnosis: the 2 ranks above never finished: fix that first" in result.stdout


def test_a_loop_that_never_ends_is_named_at_its_line_not_blamed_on_a_collective(tmp_path):
    # A loop gives no event: it is named at the time limit, where each rank's stack is. The
    # loop opens NaiveDDP's constructor, which the check reaches right after stock's DDP is
    # built (a broadcast): a few hundred milliseconds of a core at most, so that a limit of
    # 10 s is reached inside the loop on a loaded machine too (15 runs beside two busy loops
    # and 5 beside six, load average up to 10, all green), where a loop deep in a backward
    # under a limit of 3 s was not sure to be.
    lesson = (REPO / "minddp" / "ddp" / "naive.py").read_text()
    opening = "        super().__init__()\n"
    assert lesson.count(opening) == 1
    path = tmp_path / "naive.py"
    path.write_text(lesson.replace(opening, opening + "        while module is not None:  # a"
                                   " loop that never ends\n            pass\n"))
    result = cli("grade", path, "--ranks", "2", "--timeout", "10")
    assert result.returncode == 1, result.stderr[-2000:]
    line = path.read_text().splitlines().index("            pass") + 1
    for rank in (0, 1):  # where each rank was, from its stack just before the limit
        assert re.search(rf"rank {rank} at naive.py line ({line - 1}|{line}): ", result.stdout), \
            result.stdout
    assert "diagnosis: the ranks never finished within 10 s, none of them in a collective" in \
        result.stdout, result.stdout


PEER_LEFT = ("Traceback (most recent call last):\n  File \"{file}\", line 7, in _average\n"
             "    dist.all_reduce(grad)\nRuntimeError: [../gloo/transport/tcp/pair.cc:553]"
             " Connection closed by peer [127.0.0.1]:4242. GLHF!")


@pytest.mark.parametrize("race", ["rank 1 still waits at the limit", "rank 1's peer left first",
                                  "both ranks saw the peer leave"])
def test_a_hang_is_reported_alike_whichever_rank_notices_first(tmp_path, race):
    """What the grader controls: the report from what the ranks left, in every order of the
    race (rank 0 went on without the all_reduce; rank 1 waits in it)."""
    from minddp.grader.ranks.world import report
    student = tmp_path / "naive.py"
    student.write_text("")
    (tmp_path / "rank0.collectives").write_text("in broadcast (naive.py line 3)\ndone\n")
    (tmp_path / "rank1.collectives").write_text(
        "in broadcast (naive.py line 3)\ndone\nin all_reduce (naive.py line 7)\n")
    if race != "rank 1 still waits at the limit":
        (tmp_path / "rank1.error").write_text(PEER_LEFT.format(file=student.resolve()))
    if race == "both ranks saw the peer leave":
        (tmp_path / "rank0.error").write_text(PEER_LEFT.format(file=student.resolve()))
    at_limit = race == "rank 1 still waits at the limit"
    [result] = report(tmp_path, student, "naive", 2, 10, stuck="time" if at_limit else None)
    assert result["where"] == "rank 0 in none; rank 1 waits in all_reduce (naive.py line 7)"
    # (at the limit, how long it waited; where a peer left first, it ended sooner)
    assert result["diagnosis"].startswith("a collective that never completed within 10 s"
                                          if at_limit else "a collective that never completed:")


@pytest.mark.parametrize("cut", ["line ", "line 1", "line 12",
                                 'in all_reduce (naive.py line 12)\t{"sh'])
def test_a_rank_killed_while_writing_leaves_its_whole_lines_read_and_the_part_ignored(
        tmp_path, cut):
    """Ranks killed at the limit may be writing their stacks (faulthandler, piece by piece)
    or their last collective: whole lines are read, the part after them never misread."""
    from minddp.grader.ranks.world import report
    student = tmp_path / "naive.py"
    student.write_text("\n" * 11 + "        dist.all_reduce(grad)\n")
    frame = f'  File "{student.resolve()}", '
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.collectives").write_text(
            "in broadcast (naive.py line 3)\ndone\n" + (cut if "\t" in cut else ""))
        (tmp_path / f"rank{rank}.stack").write_text(
            "Thread 0x1 (most recent call first):\n" + frame + ("line 12 in _average\n"
                                                                 if rank else cut))
    [result] = report(tmp_path, student, "naive", 2, 3, stuck="time")
    assert result["where"] == ("rank 0 in none; rank 1 at naive.py line 12:"
                               " dist.all_reduce(grad)"), result["where"]
    assert result["diagnosis"].startswith("the ranks never finished within 3 s, none of them"
                                          " in a collective"), result["diagnosis"]


def test_a_rank_killed_while_writing_its_error_leaves_no_part_of_it_read(tmp_path, monkeypatch):
    """At the limit the ranks are killed one by one: a peer of the first may raise
    ("Connection closed") and be killed while it writes that traceback. Its error file
    appears whole or not at all (world.whole); the report is the hang's, not an exception's
    last line read from a part."""
    from minddp.grader.ranks import world
    student = tmp_path / "naive.py"
    student.write_text("")
    (tmp_path / "rank0.collectives").write_text("in broadcast (naive.py line 3)\ndone\n")
    (tmp_path / "rank1.collectives").write_text(
        "in broadcast (naive.py line 3)\ndone\nin all_reduce (naive.py line 7)\n")
    written = pathlib.Path.write_text

    def killed(path, text):  # the first half written, then the rank is gone
        written(path, text[:len(text) // 2])
        raise SystemExit(-9)
    monkeypatch.setattr(pathlib.Path, "write_text", killed)
    with pytest.raises(SystemExit):
        world.whole(tmp_path / "rank1.error", PEER_LEFT.format(file=student.resolve()))
    monkeypatch.undo()
    assert not (tmp_path / "rank1.error").exists() and (tmp_path / "rank1.error.part").exists()
    [result] = world.report(tmp_path, student, "naive", 2, 3, stuck="time")
    assert result["where"] == "rank 0 in none; rank 1 waits in all_reduce (naive.py line 7)"
    assert result["diagnosis"].startswith("a collective that never completed within 3 s")
    world.whole(tmp_path / "rank1.error", "Traceback (most recent call last):\nValueError: x\n")
    assert (tmp_path / "rank1.error").read_text().endswith("ValueError: x\n")  # whole


def test_the_rank_that_says_why_is_reported_not_the_peer_that_saw_it_leave(tmp_path):
    from minddp.grader.ranks.world import report
    student = tmp_path / "sharded.py"
    student.write_text("")
    (tmp_path / "rank0.error").write_text(PEER_LEFT.format(file=student.resolve()))
    (tmp_path / "rank1.error").write_text(
        f'Traceback (most recent call last):\n  File "{student.resolve()}", line 9, in gather\n'
        "    dist.all_gather(parts, mine)\nRuntimeError: ProcessGroupGloo::allgather: invalid"
        " tensor size at index 0 (expected (4), got (3))")
    [result] = report(tmp_path, student, "naive", 2, 10, stuck=None)
    assert result["where"] == "rank 1, sharded.py line 9: dist.all_gather(parts, mine)"
    assert "invalid tensor size at index 0" in result["diagnosis"]


def test_an_error_raised_far_from_its_cause_gets_the_usual_cause(tmp_path):
    # autograd finds a saved tensor changed in place when the backward runs, inside torch:
    # the grader says what usually does it (tests/test_grade.py's planted FSDP refill)
    from minddp.grader.ranks.world import report
    student = tmp_path / "fsdp.py"
    student.write_text("")
    (tmp_path / "rank0.error").write_text(
        'Traceback (most recent call last):\n  File "/torch/autograd/graph.py", line 829, in'
        " _engine_run_backward\nRuntimeError: one of the variables needed for gradient"
        " computation has been modified by an inplace operation: [torch.FloatTensor [8, 4]]")
    [result] = report(tmp_path, student, "naive", 2, 10, stuck=None)
    assert result["diagnosis"].endswith(
        "(a tensor autograd saved for the backward was changed in place after the forward used"
        " it (e.g. a gathered weight refilled with copy_ while the graph still holds it): fill"
        " it through .data, or make a new tensor)"), result["diagnosis"]


def test_a_folder_of_students_files_is_one_table(tmp_path):
    lesson = (REPO / "minddp" / "ddp" / "naive.py").read_text()
    (tmp_path / "alice.py").write_text(lesson)
    (tmp_path / "bob.py").write_text(lesson.replace("        grad.mul_(1.0 / self.world_size)\n",
                                                    ""))  # summed, not averaged
    (tmp_path / "carol.py").write_text("def nothing():\n    pass\n")
    table = cli("grade", str(tmp_path), "--exercise", "naive", "--ranks", "2")
    assert table.returncode == 1, table.stderr[-2000:]
    rows = {line.split()[0]: line for line in table.stdout.splitlines()
            if line.split() and line.split()[0].endswith(".py")}
    passed, checks = rows["alice.py"].split()[1], rows["alice.py"].split()[3]
    assert passed == checks and rows["alice.py"].split()[2] == "of"
    assert "2.000x stock's" in rows["bob.py"] and "summed, not averaged" in rows["bob.py"]
    assert "carol.py" in rows and "defines no NaiveDDP" in rows["carol.py"]
    as_csv = cli("grade", str(tmp_path), "--exercise", "naive", "--ranks", "2", "--csv")
    lines = as_csv.stdout.splitlines()
    assert lines[0] == "file,check,outcome,where,diagnosis"
    assert any(line.startswith(str(tmp_path / "alice.py")) and ",passed," in line for line in lines)
    no_exercise = cli("grade", str(tmp_path))
    assert no_exercise.returncode == 2 and "--exercise NAME" in no_exercise.stderr


SCALE = "        grad.mul_(1.0 / self.world_size)\n"
RIGHT_BUT_NOT_STOCKS = {  # name: (NaiveDDP's scaling line replaced by, what the grader names)
    "divide": ("        grad.div_(self.world_size)\n", "you divide each gradient"),
    "sum, then divide": ("", "you sum, then divide"),
    "the lesson's own": (SCALE, "one all_reduce per parameter"),
}


def test_right_averages_that_are_not_stocks_bits_are_correct_and_a_wrong_one_fails(tmp_path):
    """At 3 ranks x / 3 and x * (1/3) round apart: each right way is `correct` (exit 0), the
    difference named; a gradient 2^-20 off is beyond the bound of any order: failed."""
    lesson = (REPO / "minddp" / "ddp" / "naive.py").read_text()
    reduce = "op=dist.ReduceOp.SUM, group=self.process_group)\n"
    assert lesson.count(SCALE) == 1 and lesson.count(reduce) == 1
    for name, (scaling, named) in RIGHT_BUT_NOT_STOCKS.items():
        source = lesson.replace(SCALE, scaling)
        if name == "sum, then divide":
            source = source.replace(reduce, reduce + "            grad.div_(self.world_size)\n")
        (tmp_path / "naive.py").write_text(source)
        graded = cli("grade", str(tmp_path / "naive.py"), "--ranks", "3", "--json")
        assert graded.returncode == 0, (name, graded.stdout[-3000:], graded.stderr[-2000:])
        checks = json.loads(graded.stdout)["checks"]
        assert all(c["passed"] and c["outcome"] in ("passed", "correct") for c in checks), name
        for check in checks[:2]:  # the two models: each parts from stock's bits somewhere
            assert check["outcome"] == "correct", (name, check)
            assert "correct, not stock's bits" in check["diagnosis"] and named in \
                check["diagnosis"], (name, check)
    (tmp_path / "naive.py").write_text(lesson.replace(
        SCALE, "        grad.mul_(1.0 / self.world_size * (1 + 2 ** -20))\n"))
    graded = cli("grade", str(tmp_path / "naive.py"), "--ranks", "3", "--json")
    assert graded.returncode == 1
    for check in json.loads(graded.stdout)["checks"][:2]:
        assert check["outcome"] == "failed" and "a wrong gradient, not a different order" in \
            check["diagnosis"], check


def _divided_at_4(rank, world_size):
    """NaiveDDP dividing (x / W), graded at 4 ranks: the check on the group of ranks 1..3."""
    lesson = (REPO / "minddp" / "ddp" / "naive.py").read_text()
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory, "naive.py")
        path.write_text(lesson.replace(SCALE, RIGHT_BUT_NOT_STOCKS["divide"][0]))
        results = CHECKS["naive"](load(path, EXERCISES["naive"].lesson), rank, world_size)
    return [r for r in results if "process_group = ranks 1..3" in r["check"]]


share_spawn(_divided_at_4, [4])


def test_a_right_average_in_a_group_without_rank_0_is_judged_alike_on_every_rank():
    """x / 3 and x * (1/3) round apart: the right ways are all-reduced in the group, and
    rank 0, outside it, is sent them: every rank says correct and names the division."""
    results = shared_results(_divided_at_4, 4)
    assert all(r == results[0] for r in results), results
    (check,) = results[0]
    assert check["passed"] and check.get("outcome") == "correct", check
    assert "you divide each gradient" in check["diagnosis"], check


# FSDP's reduce_scatter written other right ways (and one wrong): at 3 ranks each rounds
# apart from stock's one flat reduce_scatter(AVG). Unit.reduce_scatter is the lesson's last
# function: its body, from the line below on, is replaced.
FSDP_BODY = ("        # Laid out as the all_gather's: row r of `flat` holds every parameter's"
             " block r.\n")
FSDP_WAYS = {  # name: (the body, the outcome, what the diagnosis must say)
    "all_reduce, divide, our rows": ("""\
        out = []
        for p, g in zip(params, grads):
            whole = g.clone()
            dist.all_reduce(whole, group=self.group)
            whole = whole / self.world_size
            local = p.shard.to_local()
            start = min(self.rank * p.rows, len(g))
            out.append(self.as_dtensor(whole[start:start + len(local)].clone(), p.full))
        return out
""", "correct", "stock's arithmetic (sum, then divide), but not its buffer"),
    "a reduce_scatter(AVG) per parameter": ("""\
        out = []
        for p, g in zip(params, grads):
            padded = F.pad(g.reshape(len(g), -1), (0, 0, 0, p.rows * self.world_size - len(g)))
            mine = padded.new_empty(p.block_numel)
            dist.reduce_scatter_single(mine, padded.reshape(-1), dist.ReduceOp.AVG, self.group)
            local = p.shard.to_local()
            out.append(self.as_dtensor(mine[:local.numel()].view_as(local), p.full))
        return out
""", "correct", "correct, not stock's bits: within"),
    "2^-20 too large": ("""\
        flat = torch.cat([F.pad(g.reshape(len(g), -1), (0, 0, 0, p.rows * self.world_size
                                                         - len(g))).view(self.world_size, -1)
                          for p, g in zip(params, grads)], dim=1)
        mine = flat.new_empty(flat.shape[1])
        dist.reduce_scatter_single(mine, flat.view(-1), dist.ReduceOp.AVG, self.group)
        mine.mul_(1 + 2 ** -20)
        pieces = mine.split([p.block_numel for p in params])
        return [self.as_dtensor(piece[:p.shard.to_local().numel()].view_as(p.shard.to_local()),
                                p.full) for p, piece in zip(params, pieces)]
""", "failed", "a wrong gradient, not a different order"),
}


def _fsdp_ways(rank, world_size):
    """{way: the fsdp check's results} for each of FSDP_WAYS (in the shared 3-rank spawn)."""
    lesson = (REPO / "minddp" / "fsdp" / "shard.py").read_text()
    assert lesson.count(FSDP_BODY) == 1
    graded = {}
    with tempfile.TemporaryDirectory() as directory:
        for i, (way, (body, _, _)) in enumerate(FSDP_WAYS.items()):
            path = pathlib.Path(directory, f"{i}", "fsdp.py")
            path.parent.mkdir()
            path.write_text(lesson[:lesson.index(FSDP_BODY)] + body)
            graded[way] = CHECKS["fsdp"](load(path, EXERCISES["fsdp"].lesson), rank, world_size)
    return graded


share_spawn(_fsdp_ways, [3])


@pytest.mark.parametrize("way", list(FSDP_WAYS))
def test_fsdp_reduced_another_right_way_is_correct_and_a_wrong_one_fails(way):
    _, outcome, said = FSDP_WAYS[way]
    for rank, graded in enumerate(shared_results(_fsdp_ways, 3)):
        [result] = graded[way]
        assert result.get("outcome", "passed") == outcome, (rank, way, result)
        assert result["passed"] == (outcome == "correct"), (rank, way, result)
        assert said in result["diagnosis"], (rank, way, result)


def test_a_group_without_rank_0_averaged_over_the_whole_world_is_named(tmp_path):
    (tmp_path / "naive.py").write_text((REPO / "minddp" / "ddp" / "naive.py").read_text().replace(
        "dist.get_world_size(process_group)", "dist.get_world_size()"))
    graded = cli("grade", str(tmp_path / "naive.py"), "--ranks", "3", "--json")
    assert graded.returncode == 1
    [failed] = [c for c in json.loads(graded.stdout)["checks"] if c["outcome"] == "failed"]
    assert failed["check"] == "3 ranks, the toy model, process_group = ranks 1..2"
    assert failed["diagnosis"] == ("0.667x stock's: divided by the whole world's size (3), not"
                                   " the group's (2): dist.get_world_size(process_group)")


def test_zero_on_a_group_without_rank_0_is_graded_and_a_group_rank_as_src_is_caught(tmp_path):
    lesson = (REPO / "minddp" / "zero" / "optimizer.py").read_text()
    (tmp_path / "zero.py").write_text(lesson)
    graded = cli("grade", tmp_path / "zero.py", "--ranks", "3", "--json")
    assert graded.returncode == 0, graded.stdout[-3000:]
    checks = json.loads(graded.stdout)["checks"]
    assert any("process_group = ranks 1..2" in c["check"] and c["passed"] for c in checks)
    mistake = "src = owner  # (the group's rank, not the global one)"
    (tmp_path / "zero.py").write_text(lesson.replace(
        "src = global_rank(self.process_group, owner)  # src= takes a global rank", mistake))
    graded = cli("grade", tmp_path / "zero.py", "--ranks", "3", "--json")
    assert graded.returncode == 1
    [failed] = [c for c in json.loads(graded.stdout)["checks"] if not c["passed"]]
    # the group's rank 0 taken for a global rank: global rank 0, outside the group
    assert re.match(r"rank [12], zero\.py line \d+: works\.append\(dist\.broadcast\(p\.data",
                    failed["where"]), failed
    assert "Global rank 0 is not part of group" in failed["diagnosis"], failed


def test_a_warm_up_not_clamped_to_the_microbatches_is_caught_at_3_ranks(tmp_path):
    (tmp_path / "pp.py").write_text((REPO / "minddp" / "pp" / "schedules.py").read_text()
                                    .replace("warmup = min(n, num_stages - stage_index)",
                                             "warmup = num_stages - stage_index"))
    graded = cli("grade", str(tmp_path / "pp.py"), "--ranks", "3", "--json")
    assert graded.returncode == 1
    [failed] = [c for c in json.loads(graded.stdout)["checks"] if c["outcome"] == "failed"]
    assert failed["check"].startswith("3 ranks, 2 microbatches (fewer than stages")
    assert failed["diagnosis"].startswith("actions missing or repeated (F2)")


def test_minddp_exercise_makes_the_folder_it_is_given(tmp_path):
    from minddp.grader.writer import main
    assert main(["naive", str(tmp_path / "exercises")]) == 0  # docs/grade.md's first command
    assert (tmp_path / "exercises" / "naive.py").read_text().startswith("# minddp exercise")
    (tmp_path / "a file").write_text("")
    assert main(["naive", str(tmp_path / "a file")]) == 2


def test_a_starting_file_written_by_minddp_exercise_is_graded_not_written_yet(tmp_path):
    wrote = run([sys.executable, "-m", "minddp", "exercise", "pp", str(tmp_path)])
    assert wrote.returncode == 0 and "wrote " in wrote.stdout, wrote.stderr
    source = (tmp_path / "pp.py").read_text()
    assert source.startswith("# minddp exercise 'pp': write each TODO below")
    assert "warmup = " not in source and 'raise NotImplementedError("TODO: one_f_one_b")' in source
    again = run([sys.executable, "-m", "minddp", "exercise", "pp", str(tmp_path)])
    assert again.returncode == 2 and "exists: it would be overwritten" in again.stderr
    graded = cli("grade", str(tmp_path / "pp.py"), "--ranks", "2")
    assert graded.returncode == 1
    assert "diagnosis: not written yet: one_f_one_b still raises NotImplementedError" in \
        graded.stdout, graded.stdout


@pytest.mark.parametrize("source, argv, said", [
    (None, ["nowhere.py"], "error: nowhere.py: no such file"),
    ("def f():\n    pass\n", [], "answers none of the exercises (by the names it defines)"),
    ("class NaiveDDP:\n    pass\n", ["--exercise", "bucketed"],
     "defines no BucketedDDP: exercise 'bucketed' asks for BucketedDDP"),
    ((REPO / "minddp" / "ddp" / "naive.py").read_text().replace(
        "def _average_gradient(self, param):", "def _average_gradient(self, param, extra):"),
     [], "NaiveDDP._average_gradient(self, param, extra) does not take the lesson's arguments"),
    ((REPO / "minddp" / "ddp" / "naive.py").read_text(), ["--ranks", "5"],
     "--ranks 5: exercise 'naive' is checked at 1, 2, 3, 4 ranks"),
])
def test_what_the_grader_cannot_use_is_one_line(tmp_path, source, argv, said):
    path = tmp_path / "naive.py"
    if source is not None:
        path.write_text(source)
    file = [str(path)] if source is not None else []
    result = run([sys.executable, "-m", "minddp", "grade", *file, *argv])
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr.splitlines()[0], result.stderr


def test_the_docs_show_what_the_grader_says():
    # docs/grade.md: one planted mistake per exercise, as `minddp grade` printed it; every
    # "at" and "diagnosis" line there is the one the grader gives now, check by check.
    doc = (REPO / "docs" / "grade.md").read_text()
    shown = {(n, m): body for n, m, body in re.findall(
        r"^### (\w+): ([^\n]+)\n\n.*?```\n(.*?)```", doc, re.M | re.S)}
    assert set(name for name, _ in shown) == set(EXERCISES), shown.keys()
    graded = shared_results(_grade, 2)[0]
    for (name, mistake), body in shown.items():
        said = [f"      at:        {r['where']}\n      diagnosis: {r['diagnosis']}"
                for r in graded[name, mistake] if not r["passed"]]
        assert said and all(_rounded(s) in _rounded(body) for s in said), (name, mistake, said)


def _rounded(text):
    """text with each float of 7 or more digits (a float32's repr) to 6: such a value may
    differ in its last bit from one process to another (clip's total norm did, in both
    yours and stock's: the reference's gradients, not the check), the words may not."""
    return re.sub(r"\d+\.\d{6,}", lambda m: f"{float(m[0]):.6g}", text)


def _run(grads, weights=None, start=None):
    """A run as diagnosis.compare() reads it: one step, 2 ranks, one parameter 'w'."""
    import numpy as np
    grads = [{"w": None if g is None else np.array(g, dtype=np.float32)} for g in grads]
    weights = weights or [[0.0, 0.0]] * 2
    start = start or [[1.0, 1.0]] * 2
    return {"start": [{"w": np.array(s, dtype=np.float32)} for s in start], "grads": [grads],
            "weights": [[{"w": np.array(w, dtype=np.float32)} for w in weights]]}


@pytest.mark.parametrize("ours, stock, said", [
    (_run([[1.0, 2.0]] * 2), _run([[1.0, 2.0]] * 2), ""),
    (_run([[1.0, 2.0]] * 2, start=[[1.0, 1.0], [5.0, 1.0]]), _run([[1.0, 2.0]] * 2),
     "ranks start from different weights"),
    (_run([None, None]), _run([[1.0, 2.0]] * 2), "no gradient: its hook never ran"),
    (_run([[1.0, 2.0]] * 2), _run([None, None]), "a gradient where stock has none"),
    (_run([[1.0, 2.0], [3.0, 2.0]]), _run([[2.0, 2.0]] * 2), "rank 1's gradients differ"),
    (_run([[2.0, 4.0]] * 2), _run([[1.0, 2.0]] * 2), "2.000x stock's, every gradient: summed"),
    (_run([[0.5, 1.0]] * 2), _run([[1.0, 2.0]] * 2), "0.500x stock's, every gradient: averaged"),
    (_run([[3.0, 6.0]] * 2), _run([[1.0, 2.0]] * 2), "3.000x stock's, every gradient: a loss"),
    (_run([[1.0, float.fromhex("0x1.000002p+1")]] * 2), _run([[1.0, 2.0]] * 2),
     "tiny: 1.0 units of the last place, the size of a different summation order"),
    (_run([[1.0, 2.5]] * 2), _run([[1.0, 2.0]] * 2), "a different gradient, not a different"),
    (_run([[1.0, 2.0]] * 2, weights=[[0.5, 0.0]] * 2), _run([[1.0, 2.0]] * 2),
     "every gradient equal to stock's, the weights parting"),
])
def test_each_diagnosis_from_its_numbers(ours, stock, said):
    from minddp.grader.judge.diagnosis import compare
    passed, where, diagnosis = compare(ours, stock, 2)
    assert passed == (said == "") and said in diagnosis, (where, diagnosis)


def test_a_hangs_mismatch_is_named_only_where_the_calls_show_it():
    from minddp.grader.ranks.mismatch import why
    world = {"group": None, "sizes": [4]}
    grader = ("all_gather_object", {"group": None, "sizes": []}, False)  # the grader's call
    # a group's ranks in a collective of the whole world, the rank outside it elsewhere
    mine = ("broadcast", world, True)  # called from the student's file
    said = why({0: grader, 1: mine, 2: mine}, 3, [1, 2])
    assert said.startswith("ranks 1, 2 of the group of ranks 1, 2 wait in broadcast on the"
                           " whole world (no group= given), which rank 0, outside the group")
    said = why({0: ("broadcast", dict(world, src=0), True),
                1: ("broadcast", dict(world, src=1), True)}, 2)
    assert said.startswith("every rank waits in broadcast, called with other src: rank 0: 0,"
                           " rank 1: 1")
    assert "other tensor sizes (elements): rank 0: [3], rank 1: [2]" in why(
        {0: ("all_gather", {"group": None, "sizes": [3]}, True),
         1: ("all_gather", {"group": None, "sizes": [2]}, True)}, 2)
    # never the wrong way: a collective on some ranks only, with no group made, or the
    # outside rank in the same collective, or calls alike: no mismatch named
    assert why({0: grader, 1: ("all_reduce", world, True)}, 2) is None
    assert why({0: mine, 1: mine, 2: mine}, 3, [1, 2]) is None
    assert why({0: ("all_reduce", world, True), 1: ("all_reduce", world, True)}, 2) is None
    assert why({1: ("all_reduce", {}, True)}, 2, [1]) is None  # no notes: nothing said
    # the group's ranks in the grader's own gathering, rank 0 stuck elsewhere: not their cause
    assert why({0: ("all_reduce", world, True), 1: grader, 2: grader}, 3, [1, 2]) is None
    assert why({0: ("broadcast", dict(world, src=0), False),
                1: ("broadcast", dict(world, src=1), False)}, 2) is None


def test_a_hang_is_certain_only_where_one_call_of_a_group_is_called_unlike():
    """world.py stops the ranks at once when mismatch.certain() says a call can never
    complete: two ranks inside the same call of one group (its ordinal), called unlike. A
    rank logged in the call before (done, not yet noted: a loaded machine) never reads so."""
    from minddp.grader.ranks.mismatch import certain, why
    world = {"group": None, "sizes": [4]}

    def at(name, call, mine=True, **seen):
        return (name, {**world, "call": call, **seen}, mine)
    gather = at("all_gather_object", 7, False, sizes=[])  # the grader's gathering
    assert certain({0: gather, 1: at("all_reduce", 7)}, 2)  # the same call, another collective
    assert not certain({0: gather, 1: at("all_reduce", 6)}, 2)  # rank 1 one call behind
    assert not certain({0: at("all_reduce", 7), 1: at("all_reduce", 7)}, 2)  # alike
    assert certain({0: at("broadcast", 3, src=0), 1: at("broadcast", 3, src=1)}, 2)
    assert certain({0: at("all_gather", 3, sizes=[3]), 1: at("all_gather", 3, sizes=[2])}, 2)
    assert not certain({0: at("send", 3, dst=1), 1: at("send", 3, dst=0)}, 2)  # their own peers
    # all_to_all: uneven splits that pair up are right; read once every rank of it is in
    # (rank i sends rank j [[1, 2], [3, 1]][i][j] rows; splits: [output's, input's])
    right = {0: at("all_to_all_single", 5, splits=[[1, 3], [1, 2]], rows=[4, 3], sizes=[8, 6]),
             1: at("all_to_all_single", 5, splits=[[2, 1], [3, 1]], rows=[3, 4], sizes=[6, 8])}
    assert not certain(right, 2)
    apart = {0: right[0], 1: at("all_to_all_single", 5, splits=[[2, 1], [1, 3]], rows=[3, 4],
                                sizes=[6, 8])}
    assert certain(apart, 2) and not certain({1: apart[1]}, 2)
    assert "rank 1 sends rank 0 1 rows, rank 0 expects 3 from it" in why(apart, 2)
    # point-to-point calls are no collective's: never "called with other dst"
    assert why({0: at("send", 3, dst=1), 1: at("send", 3, dst=0)}, 2) is None


def test_stocks_checkpoint_runs_are_kept_per_state_and_made_again_where_a_student_left_one(
        monkeypatch):
    """recompute's grader keeps stock's run of a case for the next file it grades in the same
    process; never across state a student's checkpoint could leave changed, where it runs
    stock's again (in that state, as before it kept any)."""
    import torch
    from minddp.grader.checks import recompute_runs as runs
    from minddp.memory.recompute import MATMULS
    monkeypatch.setattr(runs, "_REFERENCES", {})
    case = next(c for c in runs._recompute_cases() if c["autocast"])
    frozen = gc.get_freeze_count() > 0
    kept = runs._reference(case, "stock", MATMULS, frozen)
    assert runs._reference(case, "stock", MATMULS, frozen) is kept
    # the student's save_ops
    assert runs._reference(case, "stock", MATMULS[:1], frozen) is not kept
    fresh = runs._run(case, "stock", MATMULS, frozen)
    assert all(torch.equal(kept[k], fresh[k]) if isinstance(fresh[k], torch.Tensor)
               else kept[k] == fresh[k] for k in fresh)
    clean = runs._state()
    leaks = {"autocast left on": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
             "saved-tensors hooks left pushed": lambda: torch.autograd.graph.saved_tensors_hooks(
                 lambda t: t, lambda t: t),
             "float64 left the default": lambda: _default_dtype(torch.float64)}
    for leak, left in leaks.items():
        with left():
            assert runs._state() != clean, leak
            again = runs._reference(case, "stock", MATMULS, frozen)
            assert again is not kept, leak
            assert runs._reference(case, "stock", MATMULS, frozen) is again, leak
        assert runs._state() == clean
    assert runs._reference(case, "stock", MATMULS, frozen) is kept


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
