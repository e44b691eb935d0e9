"""The memory planner (minddp/tools/memory.py, `minddp memory`) against what ranks hold.

    pytest tests/test_memory.py

At 2 ranks (the suite's shared spawn) the small GPT trains one AdamW step under DDP,
ZeRO-1, FSDP, TP and a 2-stage pipeline, each minddp's; each rank sums the bytes of its
parameters, gradients and optimizer state (its shards, its slices, its stage) and of what
a block keeps for backward, and the planner's lines must be those bytes (ZeRO-1, which
hands out whole parameters, within the largest one). In-process: the parameters of Llama
3.2 1B, 3.1 8B and 3.1 70B counted as their model cards count them, and bad input refused
in one line.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import share_spawn, shared_results
from minddp import UsageError
from minddp.tools.memory import activation_bytes, parse, plan

SMALL = ["--layers", "2", "--hidden", "16", "--heads", "4", "--vocab", "32", "--sequence", "8",
         "--micro-batch", "4", "--precision", "fp32", "--activations", "cpu"]
CASES = {"ddp": ["--dp", "2"], "zero1": ["--dp", "2", "--zero", "1"],
         "fsdp": ["--dp", "2", "--zero", "3"], "tp": ["--tp", "2"],
         "pp": ["--pp", "2", "--untied"]}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _held(rank, world_size):
    """{case: (parameter, gradient, optimizer bytes), tp activations} on this rank."""
    from minddp import ManualDDP, ShardedOptimizer, fully_shard, pp
    from minddp.bench.recompute import kept_bytes
    from minddp.bench.transformer import Block, gpt
    from minddp.mesh.compose import tp_plan
    from minddp.mesh.device_mesh import init_device_mesh
    import minddp.tp as tp
    out = {}
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randint(0, 32, (4, 8), generator=g) for _ in range(2))
    for case in CASES:
        torch.manual_seed(0)
        model = gpt(tied=case != "pp")
        params = list(model.parameters())
        if case in ("ddp", "zero1"):
            model = ManualDDP(model)
        elif case == "fsdp":
            for block in model[1:-1]:
                fully_shard(block)
            fully_shard(model)
        elif case == "tp":
            mesh = init_device_mesh("cpu", (world_size,))
            for block in model[1:-1]:
                tp.parallelize_module(block, mesh, tp_plan(tp))
        if case == "pp":
            stage = pp.PipelineStage(pp.stage_layers(model, rank, world_size), rank, world_size)
            params = list(stage.submod.parameters())
            schedule = pp.Schedule1F1B(stage, 2, loss_fn=lambda out, t: F.cross_entropy(
                out.flatten(0, 1), t.flatten()))
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            schedule.step(*([x] if rank == 0 else []), target=y if rank == 1 else None)
        else:
            params = list(model.parameters())
            optimizer = (ShardedOptimizer(params, torch.optim.AdamW, lr=1e-2) if case == "zero1"
                         else torch.optim.AdamW(params, lr=1e-2))
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        inner = getattr(optimizer, "optim", optimizer)  # ShardedOptimizer: this rank's
        state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        out[case] = (_bytes(params), _bytes(p.grad for p in params if p.grad is not None),
                     _bytes(state), max(p.numel() for p in params))
    mesh = init_device_mesh("cpu", (world_size,))
    for policy in ("none", "selective", "full"):  # one block, split over tp=2
        from minddp.memory.recompute import POLICIES, checkpoint_module
        torch.manual_seed(0)
        block = Block(16, 4, dropout=0.1)
        tp.parallelize_module(block, mesh, tp_plan(tp))
        if POLICIES[policy] is not None:
            checkpoint_module(block, POLICIES[policy])
        out["tp activations", policy] = kept_bytes(block, 8, 4, 16, settle_s=0.2)  # (its
        # all_reduce's tensor, which gloo's thread may hold a moment longer: bench/recompute.py)
    return out


share_spawn(_held, [2])


@pytest.mark.parametrize("case", list(CASES))
def test_the_planner_says_what_each_rank_holds(case):
    rows = {what: n for what, n, _ in plan(parse(SMALL + CASES[case]))}
    for rank, out in enumerate(shared_results(_held, 2)):
        if case == "pp" and rank == 1:
            continue  # the planner speaks for the first stage (the embedding and 2 in flight)
        params, grads, state, largest = out[case]
        assert (rows["parameters"], rows["gradients"]) == (params, grads), (rank, rows, out[case])
        if case == "zero1":  # whole parameters to each rank: the split is uneven by a tensor
            assert abs(rows["optimizer"] - state) <= 8 * largest + 4 * 32, (rank, rows, state)
        else:
            assert rows["optimizer"] == state, (rank, rows, state)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_planner_says_what_a_tp_block_keeps(policy):
    args = parse(SMALL + ["--tp", "2", "--dropout", "--recompute", policy])
    for rank, out in enumerate(shared_results(_held, 2)):
        assert activation_bytes(args) == out["tp activations", policy], (rank, policy)


@pytest.mark.parametrize("name,flags,parameters", [
    ("Llama 3.2 1B", "--layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192",
     1_235_814_400),
    ("Llama 3.1 8B", "--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --untied",
     8_030_261_248),
    ("Llama 3.1 70B", "--layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --untied",
     70_553_706_496)])
def test_llamas_parameters_are_counted_as_their_model_cards(name, flags, parameters):
    args = parse(["--arch", "llama", "--vocab", "128256", "--sequence", "4096",
                  "--micro-batch", "1", *flags.split()])
    rows = {what: n for what, n, _ in plan(args)}
    assert rows["parameters"] == 2 * parameters, name  # bf16
    assert rows["optimizer"] == 12 * parameters + 4 * (9 * args.layers + 2 +
                                                        (1 if args.untied else 0)), name
    per = 4096 * 1 * args.hidden  # s b h: the Playbook's 34sbh + 5as^2b per layer
    assert rows["activations"] == args.layers * (34 * per + 5 * args.heads * 4096 * 4096), name


@pytest.mark.parametrize("flags,message", [
    ("--tp 3", "--tp 3 does not divide the 4 heads"),
    ("--pp 3", "--pp 3 does not divide the 2 layers"),
    ("--heads 3", "--heads 3 does not divide --hidden 16")])
def test_a_mesh_that_does_not_fit_is_one_line(flags, message):
    with pytest.raises(UsageError, match=message):
        plan(parse(SMALL + flags.split()))


@pytest.mark.parametrize("flags,message", [
    ("--precision fp8", "invalid choice: 'fp8'"), ("--recompute some", "invalid choice")])
def test_an_unknown_precision_or_policy_is_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parse(flags.split())
    assert exit.value.code == 2 and message in capsys.readouterr().err


# The Ultra-Scale Playbook's figure of memory against sequence length (its page's data,
# assets/data/benchmarks/memusage_activations.html): GiB at s = 1024 .. 16384, b = 1, for
# (layers, hidden, heads, vocab 128256) with its formulas: N = hv + L(12h^2 + 13h) + 2h plus
# a learned position embedding (sh), 4N parameters, 4N gradients, 8N optimizer states, and
# activations of L(34sbh + 5as^2b), plus sbh.
PLAYBOOK = {
    "Meta-Llama-3.1-8B": ((32, 4096, 32), [25.979034423828125, 25.994659423828125,
                                            26.025909423828125, 26.088409423828125,
                                            26.213409423828125],
                          [9.25390625, 28.5078125, 97.015625, 354.03125, 1348.0625]),
    "Meta-Llama-3.1-70B": ((80, 8192, 64), [243.97711181640625, 244.00836181640625,
                                             244.07086181640625, 244.19586181640625,
                                             244.44586181640625],
                           [46.2578125, 142.515625, 485.03125, 1770.0625, 6740.125]),
    "Meta-Llama-3.1-405B": ((126, 16384, 128), [1519.99072265625, 1520.05322265625,
                                                 1520.17822265625, 1520.42822265625,
                                                 1520.92822265625],
                            [145.703125, 448.90625, 1527.8125, 5575.625, 21231.25])}


@pytest.mark.parametrize("name", list(PLAYBOOK))
def test_the_planner_draws_the_playbooks_figure(name):
    (layers, hidden, heads), parameters, activations = PLAYBOOK[name]
    for s, theirs_p, theirs_a in zip([1024, 2048, 4096, 8192, 16384], parameters, activations):
        args = parse(["--arch", "gpt", "--layers", str(layers), "--hidden", str(hidden),
                      "--heads", str(heads), "--vocab", "128256", "--sequence", str(s),
                      "--micro-batch", "1", "--precision", "fp32"])
        rows = {what: n for what, n, _ in plan(args)}
        assert rows["parameters"] == rows["gradients"] == theirs_p * 2**30, (name, s)
        steps = 4 * (16 * layers + 4)  # AdamW's step counts, which the figure leaves out
        assert rows["optimizer"] - steps == 2 * theirs_p * 2**30, (name, s)
        # the figure's activations are the planner's plus s*b*h bytes (one byte an element
        # of the embedding's output: not a block's, which is all the planner counts)
        assert rows["activations"] + s * hidden == theirs_a * 2**30, (name, s)
