"""Every parallelism on one mesh: pipeline stages, tensor-parallel layers, sharded weights.

    torchrun --nproc_per_node=8 examples/gpt_nd.py --mesh pp=2,dp=2,tp=2 --untied
    pytest tests/test_capstone.py

Each lesson so far spreads one idea over all of its ranks. Real training composes them on
one DeviceMesh (device_mesh.py), each along its own dimension, and in a fixed order (torchtitan's,
the PyTorch team's training platform: its train.py splits first, then its parallelize_llama
applies TP, then activation checkpointing, then FSDP):

  1. pp: cut the model into stages; this rank keeps its stage's layers only (pp/stage.py). The
     other dimensions then work on the stage as if it were the whole model.
  2. tp: split each block's Linear layers over the tp ranks (tp/parallel.py). Before sharding: TP
     cuts whole weights into slices; fully_shard first would leave it shards to cut.
  3. dp: fully_shard each block, then the stage (fsdp/shard.py): it shards whatever it finds, so
     a TP slice is cut again into dp blocks; or DDP, which keeps whole slices and averages.
     With dp_replicate and dp_shard (HSDP), fully_shard on that 2-D slice of the mesh: blocks
     cut over dp_shard, each block kept whole on every rank of dp_replicate (dropin/hsdp.py).

Each function takes `lib`: the calls (init_device_mesh, tp, fully_shard, DDP, pipelining)
from minddp or from stock PyTorch (references/libraries.py), so one function builds both and
examples/gpt_nd.py trains the two side by side, bit for bit. In the order below:
  tp_plan        the plan for one block: column splits in, row splits out
  dp_mesh        the mesh the data-parallel wrapper spans: dp, or (dp_replicate, dp_shard)
  parallelize    split (pp), then tensor parallel (tp), then fully_shard or DDP (dp)
  pipeline       the stage and its 1F1B schedule on the pp dimension
  holdings       what this rank holds: its coordinates, its layers, its share of the weights
"""

import torch

from ..pp.stage import stage_layers


def tp_plan(tp):
    """Megatron's pairs: q, k, v and the MLP's first layer split by columns (each rank its
    heads, its hidden units), the projections after them by rows (one all_reduce each)."""
    return {"attn.q": tp.ColwiseParallel(), "attn.k": tp.ColwiseParallel(),
            "attn.v": tp.ColwiseParallel(), "attn.o": tp.RowwiseParallel(),
            "mlp.up": tp.ColwiseParallel(), "mlp.down": tp.RowwiseParallel()}


def blocks_of(stage):
    """The transformer blocks of a stage (the layers TP splits and FSDP shards one by one)."""
    return [layer for layer in stage if hasattr(layer, "attn")]


def dp_mesh(mesh):
    """The part of `mesh` data parallelism spans (None if it has none): the dp dimension, or
    torchtitan's 2-D (dp_replicate, dp_shard) for HSDP (a 2-D mesh given to fully_shard)."""
    names = mesh.mesh_dim_names
    if "dp_replicate" in names:  # (plan.py refuses it without dp_shard)
        return mesh["dp_replicate", "dp_shard"]
    if "dp_shard" in names:
        return mesh["dp_shard"]
    return mesh["dp"] if "dp" in names else None


def parallelize(model, mesh, lib, dp="fsdp", recompute=None):
    """This rank's part of `model` (an nn.Sequential: embedding, blocks, head), parallelized
    along every dimension `mesh` has; recompute: each block under checkpoint, these ops
    saved (recompute.py: () full, MATMULS selective). Returns the stage module to train
    (the whole model without pp); its layers are `model`'s own, so `model` names every
    weight. Collective."""
    names = mesh.mesh_dim_names
    stage = model
    if "pp" in names:  # 1. only this stage's layers from here on
        stage = stage_layers(model, mesh.get_local_rank("pp"), mesh["pp"].size())
    if "tp" in names:  # 2. the blocks' Linear layers, sliced over tp
        for block in blocks_of(stage):
            lib.tp.parallelize_module(block, mesh["tp"], tp_plan(lib.tp))
    if recompute is not None:  # after TP: the second forward runs the plan's ops too
        for block in blocks_of(stage):
            lib.checkpoint(block, recompute)
    data_parallel = dp_mesh(mesh)
    if data_parallel is not None and dp == "fsdp":  # 3. sharded: a unit per block, the rest
        for block in blocks_of(stage):
            lib.fully_shard(block, mesh=data_parallel)
        lib.fully_shard(stage, mesh=data_parallel)  # the embedding and head (tied: one tensor)
    elif data_parallel is not None:  # 3. or replicated over dp, gradients averaged
        stage = lib.DDP(stage, device_mesh=data_parallel)
    return stage


def pipeline(stage, mesh, lib, loss_fn, n_microbatches):
    """The 1F1B schedule of this rank's stage, its neighbours along the pp dimension."""
    here = lib.pipelining.PipelineStage(stage, mesh.get_local_rank("pp"), mesh["pp"].size(),
                                    torch.device(mesh.device_type),
                                    group=mesh["pp"].get_group())
    return lib.pipelining.Schedule1F1B(here, n_microbatches, loss_fn=loss_fn)


def _local_numel(t):
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def holdings(model, stage, mesh, whole):
    """One line: this rank's coordinates, its layers and the share of the weights it holds.
    `whole`: the elements of every weight of the unsplit model."""
    names = mesh.mesh_dim_names
    where = ", ".join(f"{n} {c}/{mesh[n].size()}" for n, c in zip(names, mesh.get_coordinate()))
    layers = [i for i, layer in enumerate(model) if any(layer is s for s in stage.modules())]
    held = sum(_local_numel(p) for p in stage.parameters())
    span = f"layers {layers[0]}-{layers[-1]} of {len(model)}"
    share = f"holds {held} of {whole} weight elements ({held / whole:.1%})"
    line = f"mesh ({where}): {span}, {share}"
    if "dp_replicate" in names:  # HSDP: the column of the (dp_replicate, dp_shard) grid
        line += f", the same shards as ranks {mesh['dp_replicate'].mesh.tolist()}"
    return line
