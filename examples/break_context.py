"""Break context parallelism and see: minddp's ring attention with one piece wrong, against stock's.

    torchrun --nproc_per_node=2 examples/break_context.py --break all      # each break in turn
    torchrun --nproc_per_node=2 examples/break_context.py --break no-lse
    torchrun --nproc_per_node=2 examples/break_context.py --break no-lse --grad-table runs/bcp.txt
    minddp diff runs/bcp-no-lse-minddp.txt runs/bcp-no-lse-reference.txt   # names the step

The small GPT (examples/context.py's: sequences of 16 tokens cut zig-zag over the ranks,
fully_shard over them) trains 3 AdamW steps on the same batches twice: under stock's ring
attention (references/stock_context.py) and under minddp's context_parallel with one piece
patched (the library itself stays unbroken). After each step every rank compares its
logits and every weight with stock's; the first step where they part and by how much is the
verdict. docs/context.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "no-lse": "the blocks' outputs merged as a plain mean, without the log-sum-exp correction",
    "mask-every-block": "is_causal=True on every block of the ring, not on the diagonal only",
    "positions": "the positions buffer left out of context_parallel's buffers (in a model"
                 " that does not check)",
}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="all", choices=[*BREAKS, "all"])
    parser.add_argument("--grad-table", metavar="PATH",
                        help="write PATH-<break>-minddp.txt and PATH-<break>-reference.txt")
    args = parser.parse_args()

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minddp.cp.ring_attention as context
from minddp import GradTable, ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0
from minddp.bench.transformer import Embedding, gpt
from minddp.references.libraries import LIBRARIES

TOKENS = 16


def plain_mean(out, lse, block_out, block_lse):
    """The broken merge: each block's output weighs the same, however much of the row's
    softmax its keys hold (lse says how much; ignored)."""
    return (block_out, block_lse) if out is None else ((out + block_out) / 2, lse)


def causal_everywhere(rank, source, is_causal, zigzag, length):
    """The broken mask: a part's keys masked as if the block sat on the diagonal."""
    part = UNBROKEN["part_of_block"](rank, source, is_causal, zigzag, length)
    return part if part is None or not is_causal else (*part[:2], True)


def positions_unchecked(self, idx):
    """Embedding.forward in a model that takes the first T positions, whatever they are."""
    return self.wte(idx) + self.wpe(self.positions[:idx.shape[1]])


UNBROKEN = {"merge": context.merge, "part_of_block": context.part_of_block,
            "forward": Embedding.forward}


def run(env, steps=3):
    models, optimizers, tables, meshes = {}, {}, {}, {}
    root, ext = os.path.splitext(args.grad_table or "")
    for who in ("reference", "minddp"):
        lib = LIBRARIES["stock" if who == "reference" else "manual"]
        meshes[who] = lib.init_device_mesh("cpu", (env.world_size,))  # cp over every rank
        torch.manual_seed(0)
        models[who] = model = gpt(tokens=TOKENS)
        lib.fully_shard(model, mesh=meshes[who])
        optimizers[who] = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tables[who] = GradTable(model, args.grad_table and f"{root}-{broken}-{who}{ext or '.txt'}")
    verdict = f"every output and weight equal to stock's after {steps} steps, bit for bit"
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same sequences on every rank
        tokens = torch.randint(0, 32, (2, TOKENS + 1), generator=g)
        logits = {}
        for who, model in models.items():
            lib = LIBRARIES["stock" if who == "reference" else "manual"]
            x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
            buffers = [x, y] + ([] if broken == "positions" and who == "minddp"
                                else [model[0].positions])
            optimizers[who].zero_grad()
            with lib.context_parallel(meshes[who], buffers=buffers,
                                      buffer_seq_dims=[1, 1, 0][:len(buffers)]):
                logits[who] = model(x)
                F.cross_entropy(logits[who].flatten(0, 1), y.flatten()).backward()
            tables[who].record()
            optimizers[who].step()
        weights = {who: [_whole(p) for p in m.parameters()] for who, m in models.items()}
        gaps = [(a - b).abs().max().item()
                for a, b in zip(weights["reference"], weights["minddp"])]
        out_gap = (logits["reference"] - logits["minddp"]).abs().max().item()
        if (out_gap or any(gaps)) and verdict.startswith("every"):
            scale = torch.finfo(torch.float32).eps * logits["reference"].abs().max().item()
            names = [n for n, _ in models["minddp"].named_parameters()]
            verdict = (f"parts from stock at step {step}: logits off by {out_gap:.3g}"
                       f" ({out_gap / scale:.3g} rounding units) on rank {dist.get_rank()};"
                       f" weights by up to {max(gaps):.3g} ({names[gaps.index(max(gaps))]})")
    for table in tables.values():
        table.save()  # collective
    return verdict


def _whole(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def patch(broken):
    context.merge = plain_mean if broken == "no-lse" else UNBROKEN["merge"]
    context.part_of_block = (causal_everywhere if broken == "mask-every-block"
                             else UNBROKEN["part_of_block"])
    Embedding.forward = positions_unchecked if broken == "positions" else UNBROKEN["forward"]


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        env = ddp_setup("gloo", "cpu")
        for broken in (BREAKS if args.broken == "all" else [args.broken]):
            patch(broken)
            print0(f"--break {broken}: {BREAKS[broken]}")
            verdicts = [None] * env.world_size
            dist.all_gather_object(verdicts, run(env))
            for rank, verdict in enumerate(verdicts):
                print0(f"    rank {rank}: {verdict}")
            patch("none")  # unbroken again
        ddp_teardown()
