"""Context parallelism: the small GPT with every sequence cut over the ranks, attention in a ring.

    torchrun --nproc_per_node=2 examples/context.py --grad-table runs/cp.txt
    torchrun --nproc_per_node=2 examples/context.py --cp reference --grad-table runs/cp-ref.txt
    minddp diff runs/cp.txt runs/cp-ref.txt            # IDENTICAL
    torchrun --nproc_per_node=4 examples/context.py --dp 2      # dp=2 x cp=2
    torchrun --nproc_per_node=4 examples/context.py --layout in-order

nanoGPT's shape at CPU sizes (minddp.bench.transformer.gpt), trained with AdamW on random
token sequences of --tokens tokens, next-token loss. The ranks form a (dp, cp) mesh: each dp
rank has its own sequences, and the cp ranks of one dp rank share them, each holding its part
of every sequence (zig-zag: chunks r and 2cp-1-r of 2cp; in order: chunk r of cp). Inside
context_parallel the tokens, the targets and the model's positions buffer hold this rank's
part, and F.scaled_dot_product_attention is ring attention over cp: minddp's
(minddp/cp/context_parallel.py) or, with --cp reference, stock's own context manager around
torch's private ring kernels (minddp/references/stock_context.py; its public path refuses CPU's
attention kernel). The weights are sharded over every rank (fully_shard on dp x cp, as
torchtitan), which averages the gradients: each rank's loss is the mean over its tokens, the
same number on every rank. Each rank prints its positions and its losses.
"""

import os

from minddp.run.cli import ArgumentParser, parse_checked, run_flags  # no torch: a typo is quick

SIZES = dict(vocab=32, d=16, heads=4)


def parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", default="manual", choices=["manual", "reference"],
                   help="minddp's ring attention, mesh and fully_shard, or stock's (its"
                        " private ring kernels: context_parallel refuses CPU's attention)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks; cp = world / dp")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "in-order"],
                   help="zigzag: rank r holds chunks r and 2cp-1-r; in-order: chunk r")
    p.add_argument("--tokens", type=int, default=16, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per step and dp rank")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps")
    return run_flags(p)  # --seed, --grad-table, --timeout, --backend, --device


def checked(args, world_size=None):
    """The mesh and the sequence against the world, before any group: one line each."""
    from minddp.launch.usage_error import UsageError
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    # (counts below 1 are refused by parse_checked, run/cli.py)
    if world_size % args.dp:
        raise UsageError(f"--dp {args.dp} does not divide the {world_size} ranks",
                         hint="cp = world size / dp must be whole", same_on_every_rank=True)
    args.cp_size = world_size // args.dp
    chunks = args.cp_size * (2 if args.layout == "zigzag" else 1)
    if args.tokens % chunks:
        raise UsageError(f"--tokens {args.tokens} does not split into {chunks} chunks"
                         f" ({args.layout} over cp={args.cp_size})",
                         hint=f"--tokens a multiple of {chunks}", same_on_every_rank=True)
    return args


if __name__ == "__main__":
    from minddp.run.errors import exit_on_usage_error
    with exit_on_usage_error():
        args = checked(parse_checked(parser()))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minddp import GradTable, ddp_setup, ddp_teardown, exit_on_failure, print0, print_rank
from minddp.bench.transformer import gpt
from minddp.cp.ring_attention import chunk_ids
from minddp.references.libraries import LIBRARIES  # minddp's calls, or stock's


def batch(args, step, dp_rank, device):
    """This dp rank's sequences at `step` (the cp ranks of one dp rank share them)."""
    g = torch.Generator().manual_seed(1000 * args.seed + 100 * step + dp_rank)
    tokens = torch.randint(0, SIZES["vocab"], (args.batch, args.tokens + 1), generator=g)
    # Each its own tensor, not two views of one: context_parallel cuts them in place.
    return tokens[:, :-1].clone().to(device), tokens[:, 1:].clone().to(device)


def main(env, args):
    lib = LIBRARIES["manual" if args.cp == "manual" else "stock"]
    zigzag = args.layout == "zigzag"
    mesh = lib.init_device_mesh(env.device.type, (args.dp, args.cp_size),
                                mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh.get_coordinate()
    torch.manual_seed(args.seed)  # the same first weights on every rank
    model = gpt(**SIZES, tokens=args.tokens).to(env.device)
    # torchtitan's composition: the weights sharded over dp and cp together, so one
    # reduce_scatter averages every rank's gradient (a cp rank's is its tokens' part)
    lib.fully_shard(model, mesh=lib.init_device_mesh(env.device.type, (env.world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    grad_table = GradTable(model, args.grad_table)  # whole gradients: a collective
    chunk = args.tokens // (args.cp_size * (2 if zigzag else 1))
    spans = [f"{c * chunk}-{(c + 1) * chunk - 1}"
             for c in chunk_ids(cp_rank, args.cp_size, zigzag)]
    print_rank(f"dp {dp_rank}, cp {cp_rank}: positions {' and '.join(spans)} of each sequence")

    for step in range(args.steps):
        tokens, targets = batch(args, step, dp_rank, env.device)
        optimizer.zero_grad()
        # Inside: tokens, targets and the positions buffer hold this rank's part (cut in
        # place), and the model's attention is the ring over the cp ranks.
        with lib.context_parallel(mesh["cp"], buffers=[tokens, targets, model[0].positions],
                                  buffer_seq_dims=[1, 1, 0], zigzag=zigzag):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()  # the ring again, backward; fully_shard averages over all ranks
        grad_table.record()
        optimizer.step()
        whole = loss.detach().clone()  # every rank's tokens: the mean of the ranks' means
        dist.all_reduce(whole)  # (a sum: gloo has no average)
        print_rank(f"step {step + 1}/{args.steps} | loss {loss.item():.6f} (this rank's"
                   f" tokens) | {whole.item() / env.world_size:.6f} (every rank's)")
    grad_table.save()  # collective: rank 0 gathers every rank's rows and writes the file


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():  # one line and a hint, exit 1 or 2
        env = ddp_setup(args.backend, args.device, args.timeout)
        print0(f"PyTorch {torch.__version__} | {env} | dp={args.dp}, cp={args.cp_size},"
               f" {args.layout} | --cp {args.cp}")
        main(env, args)
        ddp_teardown()
