"""Expert parallelism: the small GPT with mixture-of-experts MLPs, its experts over the ranks.

    torchrun --nproc_per_node=2 examples/experts.py --grad-table runs/ep.txt
    torchrun --nproc_per_node=2 examples/experts.py --ep reference --grad-table runs/ep-ref.txt
    minddp diff runs/ep.txt runs/ep-ref.txt              # IDENTICAL
    torchrun --nproc_per_node=4 examples/experts.py --dp 2 --top-k 2 --capacity-factor 1.25
    torchrun --nproc_per_node=2 examples/experts.py --invariant --grad-table runs/inv2.txt
    python examples/experts.py --invariant --grad-table runs/inv1.txt   # IDENTICAL to it

nanoGPT's shape at CPU sizes with each block's MLP a layer of --experts experts
(minddp.bench.transformer.moe_gpt; minddp/ep/experts.py), --top-k of them per token, trained
with AdamW on random token sequences, next-token loss plus --balance x Switch's balancing
loss. Every rank trains on its own sequences. The ranks form a (dp, ep) mesh: the ep ranks
split the experts between them (minddp/ep/parallel.py: tokens there and back by all_to_all), the dp
ranks hold the same ones; ep.sync_gradients averages every gradient as one process on all
the ranks' sequences would. With --ep reference every rank computes that one process
(minddp/references/moe.py): every rank's sequences through every expert, no
all_to_all, the replicated weights' parts averaged by the same all_reduce. Each rank prints
its experts, its loss and how many of its tokens' pairs each expert took (the first block).
With --invariant, --batch is the global batch, cut into --shards virtual shards run in one
order on any (dp, ep) mesh (minddp/invariant/experts.py): one process's bits on every mesh.
"""

import os

from minddp.run.cli import ArgumentParser, parse_checked, run_flags  # no torch: a typo is quick

SIZES = dict(vocab=32, d=16, heads=4, blocks=2, tokens=8)


def parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", default="manual", choices=["manual", "reference"],
                   help="minddp's expert parallelism, or one process on every rank's batch")
    p.add_argument("--dp", type=int, default=1, help="ranks holding the same experts;"
                   " ep = world / dp")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=1, help="experts per token (1: Switch, 2: GShard)")
    p.add_argument("--capacity-factor", type=float, metavar="F",
                   help="each expert takes at most ceil(F x tokens x top-k / experts) of a"
                        " rank's pairs (default: dropless)")
    p.add_argument("--balance", type=float, default=0.01, help="the balancing loss's weight")
    p.add_argument("--batch", type=int, help="sequences per step and rank (default 2); with"
                   " --invariant, of the whole step (default 8)")
    p.add_argument("--invariant", action="store_true",
                   help="one process's bits on any mesh (minddp/invariant/experts.py)")
    p.add_argument("--shards", type=int, default=4, help="--invariant: virtual shards")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps")
    return run_flags(p)  # --seed, --grad-table, --timeout, --backend, --device


def checked(args, world_size=None):
    """The mesh and the layer against the world, before any group: one line each."""
    from minddp.launch.usage_error import UsageError
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    # (counts below 1 are refused by parse_checked, run/cli.py)
    if world_size % args.dp:
        raise UsageError(f"--dp {args.dp} does not divide the {world_size} ranks",
                         hint="ep = world size / dp must be whole", same_on_every_rank=True)
    args.ep_size = world_size // args.dp
    if args.experts % args.ep_size:
        raise UsageError(f"--experts {args.experts} do not split over ep={args.ep_size} ranks",
                         hint=f"--experts a multiple of {args.ep_size}", same_on_every_rank=True)
    if not 1 <= args.top_k <= args.experts:
        raise UsageError(f"--top-k {args.top_k} with {args.experts} experts",
                         hint="--top-k 1 or 2", same_on_every_rank=True)
    if args.capacity_factor is not None and args.capacity_factor <= 0:
        raise UsageError(f"--capacity-factor {args.capacity_factor:g}: no expert could take"
                         f" a token", hint="1.0 to 2.0, or leave it out: dropless",
                         same_on_every_rank=True)
    if args.batch is None:
        args.batch = 8 if args.invariant else 2
    if args.invariant:
        check_invariant(args, world_size)
    return args


def check_invariant(args, world_size):
    """What --invariant asks: the ranks and shards in powers of two, the shards whole."""
    from minddp.invariant.tree import is_power_of_two
    from minddp.launch.usage_error import UsageError
    if args.ep != "manual":
        raise UsageError("--invariant with --ep reference: the invariant mode is its own"
                         " reference (one process)", hint="drop --ep reference",
                         same_on_every_rank=True)
    if not (is_power_of_two(args.dp) and is_power_of_two(args.ep_size)
            and is_power_of_two(args.shards)) or args.shards % world_size \
            or args.batch % args.shards:
        raise UsageError(f"--invariant with dp={args.dp}, ep={args.ep_size}, --shards"
                         f" {args.shards}, --batch {args.batch}", hint="dp, ep and --shards"
                         " powers of two; the ranks divide --shards, --shards divides --batch",
                         same_on_every_rank=True)


if __name__ == "__main__":
    from minddp.run.errors import exit_on_usage_error
    with exit_on_usage_error():
        args = checked(parse_checked(parser()))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minddp import GradTable, ddp_setup, ddp_teardown, exit_on_failure, print0, print_rank
from minddp.bench.transformer import moe_gpt
from minddp.ep.parallel import expert_parallel, sync_gradients
from minddp.mesh.device_mesh import init_device_mesh
from minddp.references.moe import OneProcessMoEGPT


def batch(args, step, rank, device):
    """Rank `rank`'s sequences at `step` (every rank its own)."""
    g = torch.Generator().manual_seed(1000 * args.seed + 100 * step + rank)
    tokens = torch.randint(0, SIZES["vocab"], (args.batch, SIZES["tokens"] + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # each token predicts the next


def invariant(env, args, mesh, model, grad_table):
    """--invariant: the global batch in shards, one order (minddp/invariant/experts.py)."""
    from minddp.invariant.experts import ExpertShardTraining
    training = ExpertShardTraining(model, mesh, shards=args.shards, balance=args.balance)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(args.steps):
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(1000 * args.seed + 100 * step)  # the whole batch
        tokens = torch.randint(0, SIZES["vocab"], (args.batch, SIZES["tokens"] + 1),
                               generator=g).to(env.device)
        loss = training.step(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        grad_table.record()
        optimizer.step()
        print0(f"step {step + 1}/{args.steps} | loss {loss.item():.6f} (every rank's)")
    grad_table.save()


def all_reduced(part):
    dist.all_reduce(part)
    return part


def main(env, args):
    mesh = init_device_mesh(env.device.type, (args.dp, args.ep_size), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(args.seed)  # the same first weights on every rank
    model = moe_gpt(**SIZES, experts=args.experts, top_k=args.top_k,
                    capacity_factor=args.capacity_factor).to(env.device)
    grad_table = GradTable(model, args.grad_table)  # made first: it names every expert
    if args.invariant:
        return invariant(env, args, mesh, model, grad_table)
    one_process = None
    if args.ep == "manual":
        expert_parallel(model, mesh)  # this rank keeps experts/ep of each layer
        mine = list(model[1].mlp.experts.mlps)
    else:
        one_process = OneProcessMoEGPT(model, env.world_size, args.ep_size)
        mine = list(model[1].mlp.experts.mlps)  # every expert, computed here
    print_rank(f"dp {mesh.get_local_rank('dp')}, ep {mesh.get_local_rank('ep')}: experts"
               f" {' '.join(mine)} of each layer")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    for step in range(args.steps):
        optimizer.zero_grad()
        if one_process is None:
            x, y = batch(args, step, env.rank, env.device)
            logits = model(x)
            balance = sum(block.mlp.balance_loss for block in list(model)[1:-1])
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + args.balance * balance
            loss.backward()  # the all_to_alls backward: each expert gets every rank's part
            sync_gradients(model, mesh)  # replicated / W; experts over dp, / W
            taken = model[1].mlp.tokens_per_expert
        else:
            data = [batch(args, step, r, env.device) for r in range(env.world_size)]
            losses = one_process.losses([d[0] for d in data], [d[1] for d in data], args.balance)
            torch.autograd.backward(losses)
            grads = one_process.gradients(lambda parts: all_reduced(parts[env.rank].clone()))
            for name, p in model.named_parameters():
                p.grad = grads[name]
            loss, taken = losses[env.rank], one_process.tokens_per_expert[env.rank]
        grad_table.record()
        optimizer.step()
        print_rank(f"step {step + 1}/{args.steps} | loss {loss.item():.6f} | pairs per expert"
                   f" (block 1) {' '.join(map(str, taken.tolist()))}")
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env} | dp={args.dp}, ep={args.ep_size},"
               f" {args.experts} experts, top-{args.top_k} | --ep {args.ep}"
               + (f" --invariant, {args.shards} shards" if args.invariant else ""))
        main(env, args)
        ddp_teardown()
