"""The invariant mode (minddp/invariant/): one program, the same bits on any mesh as in one process.

    pytest tests/test_invariant.py

The small GPT of examples/gpt_nd.py trains 5 AdamW steps in invariant mode on every mesh of
dp in {1, 2, 4} x tp in {1, 2} x pp in {1, 2} up to 4 ranks (the shared spawns of 1, 2 and
4 ranks) and of 8 ranks (the 8-rank spawn), each with fully_shard and with DDP along dp, and
with HSDP's (replicas x shards) in place of dp on five of them,
sequence parallel, --clip, dropout, recomputation and a vocabulary that the chunks do not
divide on in turn. Every step's loss, every whole gradient, and
after the last step every whole weight and AdamW state must be torch.equal to the run in
one process. The same for expert parallelism in shard order (invariant/experts.py): moe_gpt
on (dp, ep) meshes of 2 and 4 ranks, dropless and with a capacity, and a control whose
experts run every source's rows at once. Unit checks of the tree, the chunks and the
refusals run in this process.
"""

import copy
import re
import sys

import pytest
import torch
import torch.distributed as dist

from ahead import ahead_run
from helpers import REPO, share_spawn, shared_results, usage_errors
from minddp.bench.transformer import gpt
from minddp.invariant.tree import Folder, fold, tree_sum
from minddp.mesh.device_mesh import init_device_mesh
from minddp.references.libraries import LIBRARIES

SIZES = dict(vocab=32, d=16, heads=4, tokens=8)
STEPS = 5
# (dp, tp, pp) of each world size; with a 4th element, dp is HSDP's (replicas, shards)
SHAPES = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1, (2, 1))],
          4: [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (4, 1, 1, (2, 2))],
          8: [(4, 2, 1), (4, 1, 2), (2, 2, 2), (4, 2, 1, (2, 2)), (4, 1, 2, (2, 2))]}
# name: (dp, tied, clip, dropout, sequence parallel, recompute, vocabulary)
CONFIGS = {"fsdp": ("fsdp", False, 0.1, 0.1, True, "none", 32),
           "ddp, vocabulary 30, selective recompute": ("ddp", False, 0.1, 0.1, True,
                                                       "selective", 30),
           "tied, vocabulary 30, plain tp, full recompute": ("fsdp", True, None, 0.1, False,
                                                             "full", 30)}


def _mesh(shape):
    dp = [("dp", shape[0])] if len(shape) == 3 else list(zip(("dp_replicate", "dp_shard"),
                                                           shape[3]))
    dims = [(n, s) for n, s in [("pp", shape[2]), *dp, ("tp", shape[1])]
            if s > 1 or n.startswith("dp_")] or [("dp", 1)]
    return init_device_mesh("cpu", tuple(s for _, s in dims),
                            mesh_dim_names=tuple(n for n, _ in dims))


def _whole(tensor, name, cuts):
    """A weight, gradient or optimizer state, whole: gathered over dp (a fully_shard shard)
    and over tp (a slice). Collective."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    if name in cuts:
        dim, group = cuts[name]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        tensor = torch.cat(parts, dim)
    return tensor.detach().clone()


def _train(shape, config):
    """5 steps on this mesh: (losses, [{name: whole gradient}], {name: (weight, exp_avg,
    exp_avg_sq)}) for the weights this rank's stage holds."""
    from minddp.invariant.step import InvariantTraining
    from minddp.tp.plan import sliced
    from minddp.memory.recompute import POLICIES
    dp, tied, clip, dropout, sp, recompute, vocab = CONFIGS[config]
    if tied and shape[2] > 1:
        return None  # a tied embedding does not split over stages (gpt_nd.py refuses it)
    torch.manual_seed(0)
    model = gpt(**{**SIZES, "vocab": vocab}, blocks=2, tied=tied)
    training = InvariantTraining(model, _mesh(shape), dp=dp, shards=8, chunks=4, batch=8,
                                 fully_shard=LIBRARIES["manual"].fully_shard, seed=0,
                                 sequence_parallel=sp, dropout=dropout,
                                 recompute=POLICIES[recompute])
    named = dict(training.stage.named_parameters())
    optimizer = torch.optim.AdamW(named.values(), lr=1e-2, foreach=False)
    cuts = sliced(model)
    losses, grads = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (8, SIZES["tokens"] + 1), generator=g)
        optimizer.zero_grad()
        loss, whole = training.step(step, tokens[:, :-1].contiguous(),
                                    tokens[:, 1:].contiguous())
        losses.append(loss)
        grads.append({n: _whole(p.grad, n, cuts) for n, p in named.items()})
        if clip is not None:
            training.clip_grad_norm_(whole, clip)
        optimizer.step()
    state = {n: tuple(_whole(t, n, cuts) for t in (p, optimizer.state[p]["exp_avg"],
                                                   optimizer.state[p]["exp_avg_sq"]))
             for n, p in named.items()}
    return losses, grads, state


def _invariant(rank, world_size):
    return {(shape, config): _train(shape, config) for shape, config in _runs(world_size)}


share_spawn(_invariant, [1, 2, 4, 8])


def _differences(run, reference):
    """What in `run` (one rank's) is not torch.equal to the one-process `reference`."""
    (losses, grads, state), (losses_1, grads_1, state_1) = run, reference
    found = [f"step {s} loss" for s, (a, b) in enumerate(zip(losses, losses_1))
             if a is not None and not torch.equal(a, b)]
    for step, (g, g_1) in enumerate(zip(grads, grads_1)):
        found += [f"step {step} grad {n}" for n in g if not torch.equal(g[n], g_1[n])]
    found += [f"{what} {n}" for n in state for what, a, b in
              zip(("weight", "exp_avg", "exp_avg_sq"), state[n], state_1[n])
              if not torch.equal(a, b)]
    return found


def _runs(world_size):
    """(shape, configuration) pairs of a world size: HSDP's only with fully_shard."""
    return [(shape, config) for shape in SHAPES[world_size] for config in CONFIGS
            if len(shape) == 3 or CONFIGS[config][0] == "fsdp"]


def _name(shape):
    return "dp{}-tp{}-pp{}".format(*shape) + ("-hsdp{}x{}".format(*shape[3])
                                               if len(shape) > 3 else "")


@pytest.mark.parametrize("shape, config", [run for w in (2, 4, 8) for run in _runs(w)],
                         ids=[f"{_name(s)}-{c}" for w in (2, 4, 8) for s, c in _runs(w)])
def test_every_mesh_gives_one_process_bits(shape, config):
    reference = shared_results(_invariant, 1)[0][(1, 1, 1), config]
    runs = shared_results(_invariant, shape[0] * shape[1] * shape[2])
    for rank, results in enumerate(runs):
        run = results[shape, config]
        if run is None:
            continue  # tied weights over pipeline stages: refused
        assert not _differences(run, reference), (rank, _differences(run, reference)[:5])
        held = set(run[2])  # every rank compared something: its stage's weights
        assert held and held <= set(reference[2]), rank
        assert any(loss is not None for loss in run[0]) or shape[2] > 1


def test_the_folder_adds_as_the_tree_and_a_run_of_leaves_is_a_subtree():
    leaves = [torch.randn(5, generator=torch.Generator().manual_seed(i)) * 10 ** (i % 4)
              for i in range(8)]
    folder = Folder()
    for leaf in leaves:
        folder.add(leaf)
    whole = fold(leaves)
    assert torch.equal(folder.total(), whole)
    for ranks in (2, 4):  # each rank folds its run; the runs' sums, folded, are the whole's
        runs = [fold(leaves[r * 8 // ranks:(r + 1) * 8 // ranks]) for r in range(ranks)]
        assert torch.equal(fold(runs), whole)
    assert not torch.equal(sum(leaves[1:], leaves[0]), whole)  # one after another: other bits
    assert torch.equal(tree_sum(leaves), whole)  # no group: this rank alone


def test_a_folder_refuses_leaves_that_make_no_tree():
    folder = Folder()
    for leaf in torch.ones(3, 2):
        folder.add(leaf)
    said = usage_errors([("three", folder.total)])
    assert "3 leaves arrived, not a power of two" in said["three"]


def test_the_vocabulary_in_chunks_is_cross_entropy_to_rounding():
    from minddp.invariant.vocab import chunk_vocabulary
    torch.manual_seed(0)
    base = gpt(**{**SIZES, "vocab": 30}, blocks=1, tied=False)
    model = copy.deepcopy(base)
    loss_fn = chunk_vocabulary(model[0], model[-1], 4, 30)  # one process: every chunk here
    assert model[0].wte.weight.shape == (32, 16)  # 30 rows padded to 4 chunks of 8
    tokens = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss = loss_fn(model(x), y)
    expected = torch.nn.functional.cross_entropy(base(x).flatten(0, 1), y.flatten())
    loss.backward()
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        grad = p.grad[:30] if name in ("0.wte.weight", "2.lm_head.weight") else p.grad
        assert torch.allclose(grad, q.grad, rtol=1e-4, atol=1e-7), name
    assert model[0].wte.weight.grad[30:].abs().sum() == 0  # the padding's rows: no token's


@pytest.mark.parametrize("flags, message", [
    ("--mesh dp=3", "dp=3 is not a power of two"),
    ("--mesh dp=2 --shards 6", "--shards 6 with --batch 8 and dp=2"),
    ("--mesh pp=4 --untied --blocks 4 --shards 2 --batch 4", "2 microbatches for 4 pipeline"),
    ("--mesh tp=2 --chunks 8", "the heads (4) do not split into 8"),
    ("--mesh tp=4 --chunks 2", "--chunks 2 at tp=4"),
    ("--mesh dp=2 --impl stock", "stock has no invariant mode"),
    ("--mesh tp=2 --chunks 4 --sequence-parallel --recompute full", None),
])
def test_what_the_mode_cannot_order_is_one_line_before_any_group(flags, message):
    from helpers import load_script
    from minddp import UsageError
    script = load_script(REPO / "examples" / "gpt_nd.py")
    args = script.parser().parse_args(["--invariant", *flags.split()])
    world = 1
    for part in args.mesh.split(","):
        world *= int(part.split("=")[1])
    if message is None:  # taken: the invariant mode runs it
        assert script.checked(args, world).invariant
        return
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        script.checked(args, world)


BREAKS = ahead_run([sys.executable, str(REPO / "examples" / "break_invariant.py"), "--break",
                    "dp-ring", "chunks"])


def test_each_order_turned_off_parts_only_the_meshes_that_split_its_sum():
    # examples/break_invariant.py against one process: a fixed order turned off parts the
    # meshes whose sum it orders, by a few units in the last place, and no other mesh. (Not
    # the clip's: its norm is one number, whose bits a reorder changes on some meshes only.)
    result = BREAKS.result()
    assert result.returncode == 0, result.stderr[-3000:]
    parted = {}
    for block in result.stdout.split("\nbreak ")[1:]:
        rows = re.findall(r"^(\S+)[ \t]+(IDENTICAL|DIFFERENT)[ \t]*(.*?)[ \t]*(\d*)$", block,
                          re.M)  # (not \s: a row's match must not run on into the next)
        assert len(rows) == 6, block
        parted[block.split(":")[0]] = {mesh: int(ulps) for mesh, verdict, _, ulps in rows
                                       if verdict == "DIFFERENT"}
    # gloo's ring over 2 ranks is one addition per element: only dp=4 parts
    assert set(parted["dp-ring"]) == {"dp=4"}
    assert set(parted["chunks"]) == {"tp=2", "dp=2,tp=2", "pp=2,tp=2"}  # every tp mesh
    assert all(0 < ulps < 1000 for found in parted.values() for ulps in found.values()), parted


def test_the_picture_draws_one_tree_per_dp_and_the_measured_ratios(tmp_path):
    from minddp.tools.tree_picture import RANK_COLORS, TOGETHER, draw_invariant, tree_nodes
    from matplotlib.colors import to_rgb
    rows = [{"mesh": "dp=2", "mode": "invariant", "ratio": 1.9},
            {"mesh": "dp=2", "mode": "normal", "ratio": 1.0},
            {"mesh": "tp=2", "mode": "invariant", "ratio": 6.03}]
    drawn = draw_invariant(rows, tmp_path / "invariant.png", "test")
    assert drawn["ratios"] == {"dp=2": 1.9, "tp=2": 6.03}  # the invariant rows, as measured
    for ranks in (1, 2, 4):  # 15 nodes; a leaf's colour is the rank whose run holds it
        colors = dict(drawn["tree"][ranks])
        assert len(colors) == 15
        for leaf in range(8):
            assert colors[f"{ranks}|0|{leaf}"] == list(to_rgb(RANK_COLORS[leaf * ranks // 8]))
        together = [g for g, c in colors.items() if c == list(to_rgb(TOGETHER))]
        assert len(together) == ranks - 1  # the sums over ranks: a tree of ranks - 1 adds
    assert tree_nodes(8, 4)[-1] == (3, 0, None) and tree_nodes(8, 1)[-1] == (3, 0, 0)


# Expert parallelism (minddp/invariant/experts.py): moe_gpt on (dp, ep) meshes in shard order.
EXPERT_MESHES = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2)]}
# name: (top_k, capacity factor)
EXPERT_CONFIGS = {"top-1 dropless": (1, None), "top-2, capacity 1.25": (2, 1.25)}


def _train_experts(dp, ep, config, together=False):
    """3 AdamW steps: (losses, [{name: gradient}], {name: weight}) of the weights held here."""
    from minddp.bench.transformer import moe_gpt
    from minddp.invariant import experts
    top_k, capacity = EXPERT_CONFIGS[config]
    torch.manual_seed(0)
    model = moe_gpt(**SIZES, blocks=2, experts=4, top_k=top_k, capacity_factor=capacity)
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    if together:  # the normal mode's order: an expert runs every source's rows at once
        experts.ShardExperts, kept = _Together, experts.ShardExperts
    try:
        training = experts.ExpertShardTraining(model, mesh, shards=4)
    finally:
        if together:
            experts.ShardExperts = kept
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, grads = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(200 + step)
        tokens = torch.randint(0, SIZES["vocab"], (8, SIZES["tokens"] + 1), generator=g)
        optimizer.zero_grad()
        losses.append(training.step(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _together_class():
    from minddp.invariant.experts import ShardExperts

    class Together(ShardExperts):
        def forward(self, routed, counts):
            rows = torch.empty_like(counts)
            dist.all_to_all_single(rows, counts, group=self.group)
            rows = rows.view(self.size, self.per_rank)
            send = counts.view(self.size, self.per_rank).sum(1).tolist()
            arrived = _all_to_all(routed, send, rows.sum(1).tolist(), self.group)
            expert_of = torch.arange(self.per_rank).repeat(self.size).repeat_interleave(
                rows.flatten())
            order = torch.argsort(expert_of, stable=True)
            runs = arrived[order].split(rows.sum(0).tolist())
            out = torch.cat([self._run(mlp, run.clone(), self.step)
                             for mlp, run in zip(self.mlps.values(), runs)])
            return _all_to_all(out[torch.argsort(order)], rows.sum(1).tolist(), send,
                               self.group)
    return Together


def _all_to_all(*args):
    from minddp.ep.parallel import all_to_all
    return all_to_all(*args)


_Together = None


def _experts(rank, world_size):
    global _Together
    _Together = _together_class()
    found = {(mesh, config): _train_experts(*mesh, config)
             for mesh in EXPERT_MESHES[world_size] for config in EXPERT_CONFIGS}
    if world_size == 2:
        found["together"] = _train_experts(1, 2, "top-1 dropless", together=True)
    return found


share_spawn(_experts, [1, 2, 4])


@pytest.mark.parametrize("mesh, config", [(m, c) for w in (2, 4) for m in EXPERT_MESHES[w]
                                          for c in EXPERT_CONFIGS],
                         ids=[f"dp{m[0]}-ep{m[1]}-{c}" for w in (2, 4)
                              for m in EXPERT_MESHES[w] for c in EXPERT_CONFIGS])
def test_experts_in_shard_order_give_one_process_bits_on_every_mesh(mesh, config):
    (losses_1, grads_1, weights_1), = [r[(1, 1), config] for r in shared_results(_experts, 1)]
    for rank, results in enumerate(shared_results(_experts, mesh[0] * mesh[1])):
        losses, grads, weights = results[mesh, config]
        assert all(torch.equal(a, b) for a, b in zip(losses, losses_1)), rank
        for step, (g, g_1) in enumerate(zip(grads, grads_1)):
            differ = [n for n in g if not torch.equal(g[n], g_1[n])]
            assert not differ, (rank, step, differ[:5])
        assert not [n for n in weights if not torch.equal(weights[n], weights_1[n])], rank
        experts_here = [n for n in weights if ".experts." in n]
        assert len(experts_here) == 2 * 4 * 4 // mesh[1]  # blocks x weights x its experts


def test_an_expert_running_every_source_at_once_parts_from_one_process():
    # The control: the same step with each expert's rows from both ep ranks in one matmul,
    # as ep/parallel.py runs them, parts from one process at step 0 (the experts' gradients,
    # and through their outputs' bits the weights before them).
    _, grads_1, _ = shared_results(_experts, 1)[0][(1, 1), "top-1 dropless"]
    for rank, results in enumerate(shared_results(_experts, 2)):
        _, grads, _ = results["together"]
        differ = [n for n in grads[0] if not torch.equal(grads[0][n], grads_1[0][n])]
        assert any(".experts." in n for n in differ), (rank, differ)
