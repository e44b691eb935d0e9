"""Break FSDP and see: minddp's fully_shard with one move done wrong, and the damage, measured.

    torchrun --nproc_per_node=2 examples/break_fsdp.py --break all     # each break in turn
    python examples/break_fsdp.py --break free

The model is the benchmark's 0.3M-parameter MLP (4 Linear layers of 256 x 256, a 10-way
head), one unit per Linear layer; 3 AdamW steps beside an unbroken copy. Each break patches
one method of the lesson's Unit (minddp/fsdp/shard.py); the library itself stays unbroken. What is
measured: the bytes of whole (gathered) weights still allocated when forward ends, which
resharding exists to free, and whether the weights equal the unbroken run's.
docs/fsdp.md shows the output and says why.
"""

from minddp.run.cli import ArgumentParser

BREAKS = {
    "none": "everything in place",
    "gather": "no all_gather before backward: the weights stay freed after forward",
    "free": "reshard swaps the shards back in (as a .data swap would) but frees no storage",
}

if __name__ == "__main__":  # the flags first, before torch loads: a typo costs a moment
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--break", dest="broken", default="all", choices=[*BREAKS, "all"])
    args = parser.parse_args()

import copy

import torch
import torch.nn.functional as F

from minddp import ddp_setup, ddp_teardown, exit_on_failure, exit_on_usage_error, print0
from minddp.bench.harness import mlp
from minddp.fsdp.shard import fully_shard, unit_of
from minddp.tools.whole_tensors import full_state_dict

def skip_gather_before_backward(unit):
    original = unit._pre_backward

    def pre_backward(grad):
        unit.unshard = lambda: None  # the break: backward starts on freed weights
        try:
            return original(grad)
        finally:
            del unit.unshard
    unit._pre_backward = pre_backward


def reshard_without_freeing(unit):
    def reshard():
        for p in unit.params:
            p.show(p.shard)  # the break: the module gets its shards back, the storage stays
        unit.is_unsharded = False
    unit.reshard = reshard


def sharded(base, broken):
    model = copy.deepcopy(base)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
            if broken == "gather":
                skip_gather_before_backward(unit_of(layer))
            if broken == "free":
                reshard_without_freeing(unit_of(layer))
    return fully_shard(model)


def forward_then_count(model, x, y):
    """The loss, and the bytes of whole weights still allocated when forward has ended."""
    loss = F.cross_entropy(model(x), y)
    units = [unit_of(m) for m in model.modules() if unit_of(m) is not None]
    return loss, sum(p.full.untyped_storage().nbytes() for u in units for p in u.params)


def run(env, broken, steps=3):
    torch.manual_seed(0)
    base = mlp(256, 4)
    models = {"unbroken": sharded(base, "none"), broken: sharded(base, broken)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(env.rank)
    held = {}
    for step in range(steps):
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
        for name, model in models.items():
            optimizers[name].zero_grad()
            loss, held[name] = forward_then_count(model, x, y)
            try:
                loss.backward()
            except RuntimeError as e:
                return f"backward failed: {str(e).splitlines()[0]}"
            optimizers[name].step()
    mb = sum(p.numel() for p in base.parameters()) * 4 / 2**20
    same = all(torch.equal(a, b) for a, b in zip(full_state_dict(models["unbroken"]).values(),
                                                  full_state_dict(models[broken]).values()))
    return (f"whole weights allocated after forward: {held[broken] / 2**20:.2f} MB"
            f" (unbroken: {held['unbroken'] / 2**20:.2f} MB; the model: {mb:.2f} MB);"
            f" weights after {steps} steps {'equal to' if same else 'DIFFER from'} the unbroken"
            f" run's")


def main(args):
    env = ddp_setup("gloo", "cpu")
    for broken in (BREAKS if args.broken == "all" else [args.broken]):
        print0(f"--break {broken}: {BREAKS[broken]}\n    {run(env, broken)}")
    ddp_teardown()


if __name__ == "__main__":
    with exit_on_failure(), exit_on_usage_error():
        main(args)
