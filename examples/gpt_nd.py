"""The capstone: a small GPT trained on a mesh of pipeline, data and tensor parallelism.

    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp=2,tp=2 --grad-table runs/nd.txt
    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp=2,tp=2 --impl stock \\
        --grad-table runs/nd-stock.txt
    minddp diff runs/nd.txt runs/nd-stock.txt          # IDENTICAL
    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh pp=2,dp=2 --untied
    torchrun --nproc_per_node=8 examples/gpt_nd.py --mesh pp=2,dp=2,tp=2 --untied --clip 0.1
    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp_replicate=2,dp_shard=2   # HSDP
    torchrun --nproc_per_node=2 examples/gpt_nd.py --recompute selective --dropout 0.1

nanoGPT's shape at CPU sizes (minddp.bench.transformer.gpt: token and learned position
embeddings, pre-LN blocks with causal attention and an MLP, the output layer tied to the
token embedding), trained with AdamW on random token sequences, next-token loss. The mesh
(--mesh, outermost first) is built by minddp's init_device_mesh or stock's, and the model
is parallelized in torchtitan's order (minddp/mesh/compose.py): cut into pipeline stages over pp
(1F1B, max(2, pp) microbatches), each block's layers split over tp, then fully_shard (or
--dp ddp) over dp, or over the 2-D (dp_replicate, dp_shard) as HSDP. Each dp rank trains on its
own batches (HSDP's numbered row by row); the tp ranks of one dp rank share them.
--recompute runs each block under checkpoint (minddp/memory/recompute.py; stock's composable
checkpoint), after TP and before fully_shard: full keeps only the block's input, selective
the matmuls' and attention's outputs too; --dropout puts nanoGPT's residual dropout in.
--clip clips the norm of the whole model's gradient, taken over every rank (minddp/mesh/clip.py;
stock's calls in torchtitan's way, references/libraries.py), after the table records it.
Each rank prints its coordinates and what it holds; the gradient table holds each rank's
whole gradients, gathered over dp and tp (a pipeline's other stages' weights: NaN).
"""

import os

from minddp.run.cli import ArgumentParser, parse_checked, run_flags  # no torch: a typo is quick

SIZES = dict(vocab=32, d=16, heads=4, tokens=8)


def parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", help="dimensions outermost first, e.g. pp=2,dp=2,tp=2 or"
                   " dp_replicate=2,dp_shard=2 (HSDP; their product: the world size; default:"
                   " dp=the world size)")
    p.add_argument("--impl", default="manual", choices=["manual", "stock"],
                   help="minddp's mesh, TP, FSDP, DDP and pipeline, or stock PyTorch's")
    p.add_argument("--dp", default="fsdp", choices=["fsdp", "ddp"],
                   help="along dp: shard the weights (fully_shard) or replicate them (DDP)")
    p.add_argument("--blocks", type=int, default=2, help="transformer blocks")
    p.add_argument("--untied", action="store_true",
                   help="the output layer its own weight (a pipeline needs it)")
    p.add_argument("--recompute", default="none", choices=["none", "full", "selective"],
                   help="each block's activations: kept, or recomputed in backward"
                        " (selective: all but the matmuls' and attention's)")
    p.add_argument("--dropout", type=float, default=0.0, help="the blocks' residual dropout")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps")
    p.add_argument("--clip", type=float, metavar="MAX_NORM",
                   help="clip the whole model's gradient norm, over every rank (clip.py)")
    p.add_argument("--batch", type=int, help="sequences per step and dp rank (default 4);"
                   " with --invariant: in the whole step, on any mesh (default 8)")
    p.add_argument("--invariant", action="store_true", help="one order for every sum a mesh"
                   " reorders: the same bits on any mesh as in one process (minddp/invariant/)")
    p.add_argument("--shards", type=int, default=8, help="--invariant: the batch's virtual"
                   " shards, each its own backward (a power of two that dp divides)")
    p.add_argument("--chunks", type=int, default=4, help="--invariant: each tp-split"
                   " dimension's chunks, on any tp (a power of two that tp divides)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="--invariant: the blocks' LayerNorms on each tp rank's tokens")
    return run_flags(p)  # --seed, --grad-table, --timeout, --backend, --device


def checked(args, world_size=None):
    """The mesh against the model and the world (torchrun's), before any group: one line."""
    from minddp.mesh.plan import check_fits, parse_mesh
    from minddp.launch.usage_error import UsageError
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    args.mesh = args.mesh or f"dp={world_size}"
    args.shape, args.names = parse_mesh(args.mesh)
    check_fits(args.shape, args.names, world_size, heads=SIZES["heads"], blocks=args.blocks,
               tied=not args.untied, dp=None if args.invariant else args.dp)
    pp, tp = (dict(zip(args.names, args.shape)).get(n, 1) for n in ("pp", "tp"))
    if args.invariant:
        from minddp.invariant.plan import check_invariant
        args.batch = args.batch or 8
        check_invariant(args, SIZES, dict(zip(args.names, args.shape)))
        return args
    args.batch = args.batch or 4
    if args.sequence_parallel:
        raise UsageError("--sequence-parallel is the invariant mode's (--invariant): the"
                         " normal mode's sequence parallel is proved in tests/test_mesh.py",
                         hint="add --invariant", same_on_every_rank=True)
    if args.clip is not None and args.dp == "ddp" and tp > 1:
        # Stock's DDP over TP takes each TP weight out of module.parameters() in forward
        # (a DTensor made from its local Parameter stands in its place): a clip over the
        # module's parameters would not see them.
        raise UsageError("--clip with --dp ddp and tp: stock's DDP over TP hides the TP"
                         " weights from module.parameters(), which the clip walks",
                         hint="clip with --dp fsdp (torchtitan's composition)",
                         same_on_every_rank=True)
    if pp > 1 and args.batch % max(2, pp):
        raise UsageError(f"--batch {args.batch} does not split into {max(2, pp)} microbatches"
                         f" (1F1B on {pp} stages: at least one per stage)",
                         hint=f"use a --batch that {max(2, pp)} divides", same_on_every_rank=True)
    return args


if __name__ == "__main__":
    from minddp.run.errors import exit_on_usage_error
    with exit_on_usage_error():
        args = checked(parse_checked(parser()))

import torch
import torch.nn.functional as F

from minddp import (GradTable, ddp_setup, ddp_teardown, exit_on_failure, print0, print_rank)
from minddp.bench.transformer import gpt
from minddp.mesh.compose import holdings, parallelize, pipeline
from minddp.references.libraries import LIBRARIES  # minddp's calls, or stock's
from minddp.memory.recompute import POLICIES  # --recompute: the ops each policy keeps


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(args, step, dp_rank, device):
    """This dp rank's sequences at `step` (the tp and pp ranks of one dp rank share them)."""
    g = torch.Generator().manual_seed(1000 * args.seed + 100 * step + dp_rank)
    tokens = torch.randint(0, SIZES["vocab"], (args.batch, SIZES["tokens"] + 1), generator=g)
    # each token predicts the next; contiguous: stock's pipeline stage on torch 2.11 checks
    # strides, and refuses a view's (9, 1) where it expects a whole tensor's (8, 1)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def main(env, args):
    if args.invariant:
        return main_invariant(env, args)
    lib = LIBRARIES[args.impl]
    mesh = lib.init_device_mesh(env.device.type, args.shape, mesh_dim_names=args.names)
    torch.manual_seed(args.seed)  # the same first weights on every rank
    model = gpt(**SIZES, blocks=args.blocks, tied=not args.untied,
                dropout=args.dropout).to(env.device)
    whole = sum(p.numel() for p in model.parameters())
    stage = parallelize(model, mesh, lib, args.dp, POLICIES[args.recompute])
    print_rank(holdings(model, stage, mesh, whole))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, foreach=False)
    grad_table = GradTable(model, args.grad_table)  # whole gradients: a collective
    pp = "pp" in args.names
    microbatches = max(2, mesh["pp"].size()) if pp else None  # 1F1B: one or more per stage
    schedule = pipeline(stage, mesh, lib, next_token_loss, microbatches) if pp else None
    coordinate = dict(zip(args.names, mesh.get_coordinate()))
    first = coordinate.get("pp", 0) == 0
    last = coordinate.get("pp", 0) == mesh["pp"].size() - 1 if pp else True

    size = dict(zip(args.names, args.shape))
    # each dp rank its own batches; HSDP's dp ranks row by row: dp_replicate r, dp_shard s
    # is r * dp_shard + s
    dp_rank = coordinate.get("dp", coordinate.get("dp_replicate", 0) * size.get("dp_shard", 1)
                             + coordinate.get("dp_shard", 0))
    for step in range(args.steps):
        x, y = batch(args, step, dp_rank, env.device)
        optimizer.zero_grad()
        if pp:  # the first stage feeds the tokens, the last computes the loss
            losses = []
            schedule.step(*([x] if first else []), target=y if last else None,
                          losses=losses if last else None)
            loss = torch.stack(losses).mean() if last else None
        else:
            loss = next_token_loss(stage(x), y)
            loss.backward()
        grad_table.record()
        norm = None if args.clip is None else lib.clip_grad_norm_(stage, args.clip, mesh)
        optimizer.step()
        if last and coordinate.get("tp", 0) == 0:  # one line per dp rank
            print_rank(f"step {step + 1}/{args.steps} | loss {loss.item():.6f}"
                       + ("" if norm is None else f" | grad norm {norm.item():.9g}"))  # every bit
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file


def main_invariant(env, args):
    """The same training in one order (minddp/invariant/step.py): the global batch --batch,
    on any mesh; every line printed once, by the rank that holds the loss."""
    from minddp.invariant.step import InvariantTraining
    mesh = LIBRARIES["manual"].init_device_mesh(env.device.type, args.shape,
                                                mesh_dim_names=args.names)
    torch.manual_seed(args.seed)  # the same first weights on every rank
    model = gpt(**SIZES, blocks=args.blocks, tied=not args.untied).to(env.device)
    training = InvariantTraining(model, mesh, dp=args.dp, shards=args.shards,
                                 fully_shard=LIBRARIES["manual"].fully_shard,
                                 chunks=args.chunks, batch=args.batch, seed=args.seed,
                                 sequence_parallel=args.sequence_parallel, dropout=args.dropout,
                                 recompute=POLICIES[args.recompute])
    optimizer = torch.optim.AdamW(training.stage.parameters(), lr=1e-2, foreach=False)
    grad_table = GradTable(model, args.grad_table)
    prints = training.last and all(c == 0 for n, c in zip(args.names, mesh.get_coordinate())
                                   if n != "pp")
    for step in range(args.steps):
        x, y = batch(args, step, 0, env.device)  # the whole step's batch: every shard
        optimizer.zero_grad()
        loss, whole = training.step(step, x, y)
        grad_table.record()
        norm = None if args.clip is None else training.clip_grad_norm_(whole, args.clip)
        optimizer.step()
        if prints:
            print_rank(f"step {step + 1}/{args.steps} | loss {loss.item():.9g}"
                       + ("" if norm is None else f" | grad norm {norm.item():.9g}"))
    grad_table.save()


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env} | --mesh {args.mesh} --impl {args.impl}")
        main(env, args)
        ddp_teardown()
