"""Break recomputation and see: memory/recompute.py's checkpoint beside stock's, one piece off.

    python examples/break_recompute.py --break all           # each break in turn
    python examples/break_recompute.py --break rng

The small GPT (bench/transformer.py's gpt(), residual dropout 0.1), each block under a
checkpoint, trains 3 AdamW steps three times on the same batches: without checkpointing,
under minddp's checkpoint_module and under stock's composable checkpoint, both with the
same piece off. After each step the checkpointed runs' gradients are compared with no
checkpointing's; the first step where they part and by how much is the verdict.
docs/recompute.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "rng": "preserve_rng_state=False: the second forward draws its dropout masks anew",
    "in-place": "the blocks' input changed in place between the forward and the backward",
}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="all", choices=[*BREAKS, "all"])
    args = parser.parse_args()

import torch
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as stock_checkpoint

from minddp.bench.transformer import gpt
from minddp.memory.recompute import checkpoint_module

CHECKPOINTS = {"none": None,
               "minddp": lambda block, rng: checkpoint_module(block, preserve_rng_state=rng),
               "stock": lambda block, rng: stock_checkpoint(block, preserve_rng_state=rng)}


class Doubled(torch.nn.Module):
    """The blocks' input, doubled in place once their forward is done (the in-place break):
    a reference kept to it, then changed, as a student's logging code might."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        x = self.model[0](idx)
        y = self.model[1:](x)
        with torch.no_grad():
            x.mul_(2)  # the break: after the forward that saved it, before the backward
        return y


def train(who, broken, steps=3):
    torch.manual_seed(0)
    model = gpt(dropout=0.1)
    if CHECKPOINTS[who]:
        for block in model[1:-1]:
            CHECKPOINTS[who](block, broken != "rng")
    runner = Doubled(model) if broken == "in-place" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the dropout masks: the same draws in every run
    grads = []
    for _ in range(steps):
        idx, target = (torch.randint(0, 32, (4, 8), generator=g) for _ in range(2))
        optimizer.zero_grad()
        loss = F.cross_entropy(runner(idx).flatten(0, 1), target.flatten())
        try:
            loss.backward()
        except RuntimeError as e:  # autograd's refusal, or the checkpoint's
            return str(e).splitlines()[0][:150]
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


def verdict(grads, reference):
    if isinstance(grads, str):
        return f"refused in backward: {grads}"
    for step, (ours, theirs) in enumerate(zip(grads, reference)):
        gap = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
        if gap:
            return f"parts from no checkpointing at step {step}: gradients off by up to {gap:.3g}"
    return f"every gradient equal to no checkpointing's, {len(grads)} steps"


def main(broken):
    print(f"--break {broken}: {BREAKS[broken]}")
    reference = train("none", "none" if broken == "rng" else broken)
    if isinstance(reference, str):
        print(f"    no checkpointing: refused in backward: {reference}")
        reference = train("none", "none")
    for who in ("minddp", "stock"):
        print(f"    {who}: {verdict(train(who, broken), reference)}")


if __name__ == "__main__":
    for broken in BREAKS if args.broken == "all" else [args.broken]:
        main(broken)
