"""Where the bits come from: every sum of a training step that a mesh reorders, in one order.

    python examples/gpt_nd.py --invariant --grad-table runs/one.txt          # one process
    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp=2,tp=2 --invariant \\
        --grad-table runs/dp2tp2.txt
    minddp diff runs/dp2tp2.txt runs/one.txt         # IDENTICAL: one process's bits

The normal mode is stock's, bit for bit: the mesh chapter's compositions equal stock's same
composition, but two meshes differ in the last bits, and a bug hides among those bits. Each
sum below is added in an order that the mesh chooses; the invariant mode gives it one:

  sum                    normal mode: the order on a mesh        invariant mode: one order
  the batch's gradient   each dp rank's rows inside its matmuls, V virtual shards, each its
                         then gloo's ring over dp (fully_shard:  own backward, folded by
                         its reduce_scatter, HSDP: and over the  tree.py's tree, then over dp
                         replicas)                               (shards.py)
  microbatches           pp: added into .grad as they come, / n  the same shards, folded as
                                                                 they come
  a row split's output   each tp rank's slice of K, all_reduce   C chunks, each alone, the
  a column split's       the same, in backward                   tree over chunks (chunks.py)
    input gradient
  the vocabulary's       vocabulary-parallel: each tp rank's     C chunks of rows, the tree
    softmax sum, the       rows, then all_reduce                   (vocab.py)
    head's input grad
  LayerNorm weights,     sequence parallel: each tp rank's       C token chunks, the tree
    a row split's bias   tokens, then all_reduce
  the loss               each dp rank's mean, then all_reduce    the shards' losses, the tree
  the clip's norm        each rank's squares, summed over the    each whole gradient's norm,
                         mesh (mesh/clip.py)                     then the norms (clip.py)
  dropout's masks        the global generator of each rank       per (seed, step, shard,
                                                                 block) (shards.py)

What stays as it is: every elementwise op (GELU, the residual adds, AdamW), the rows of a
matmul (a column slice of its output, the same bits), attention within a head, the
pipeline's sends, fully_shard's all_gather: each is exact, or computed on the same operands.
The rule behind every line: the same kernels on operands of the same shapes, fresh in
memory, on every mesh; every sum a mesh splits is a tree over leaves the mesh does not
choose. Its price, measured in docs/invariant.md: a backward per shard, C small matmuls for
one, a tree that sends the ring's bytes in log2 W steps, and one intra-op thread (a kernel
that splits a sum over threads adds in the threads' order).
"""

import torch

from ..memory.recompute import checkpoint_module
from ..mesh.compose import blocks_of, dp_mesh
from ..pp import PipelineStage, Schedule1F1B, stage_layers
from .chunks import chunk_block
from .clip import clip_grad_norm_
from .shards import ShardDropout, ShardGradients, shard_loss
from .tokens import sequence_parallel_between
from .vocab import chunk_vocabulary


class InvariantTraining:
    """`model` (bench/transformer.py's gpt) on `mesh` (dimensions of pp, dp, tp), trained in
    one order: the same bits on every mesh, the same as one process. Collective.
    dp="fsdp": the weights sharded by `fully_shard` (minddp.fully_shard, which shards a tied
    weight once), its sum replaced by ours; "ddp": whole on every rank. recompute: each
    block under memory/recompute.py's checkpoint, these ops saved (() full)."""

    def __init__(self, model, mesh, *, dp="fsdp", fully_shard=None, shards=8, chunks=4,
                 batch=8, sequence_parallel=False, dropout=0.0, seed=0, recompute=None):
        torch.set_num_threads(1)  # a sum split over threads would add in their order
        size = {n: mesh.size(n) for n in mesh.mesh_dim_names}
        group = {n: mesh.get_group(n) if size[n] > 1 else None for n in size}
        self.model, self.shards, self.batch = model, shards, batch
        # Data parallel: dp, or HSDP's replicas of shard groups, numbered row by row; the
        # tree over them is the shard groups' tree, then the replicas' (tree.py).
        rows = [n for n in ("dp", "dp_replicate", "dp_shard") if n in size]
        self.dp, self.dp_rank = 1, 0
        for n in rows:
            self.dp_rank = self.dp_rank * size[n] + mesh.get_local_rank(n)
            self.dp *= size[n]
        self.dp_group = [group[n] for n in reversed(rows) if group[n] is not None]
        self.here = shards // self.dp  # shards per dp rank (plan.py checked them)
        self.stage = stage = model  # 1. pp: this rank's stage of the layers
        pp, self.pp_group = size.get("pp", 1), group.get("pp")
        pp_rank = mesh.get_local_rank("pp") if "pp" in size else 0
        if pp > 1:
            stage = self.stage = stage_layers(model, pp_rank, pp)
        tp_group = group.get("tp")  # 2. tp: C chunks on every mesh, C / tp of them here
        sp = sequence_parallel and tp_group is not None
        tp_place = (size["tp"], mesh.get_local_rank("tp")) if sp else (1, 0)
        self.dropout = ShardDropout(dropout, seed, self.dp_rank * self.here, tp_place)
        for index, block in enumerate(blocks_of(model)):
            if any(block is m for m in stage.modules()):
                chunk_block(block, chunks, tp_group, sp, self.dropout.drop)
                if recompute is not None:  # after the chunks: the second forward runs them
                    checkpoint_module(block, save_ops=recompute)
                block.register_forward_pre_hook(self.dropout.seed_block(index))
        held = [m if any(m is s for s in stage) else None for m in (model[0], model[-1])]
        vocab = model[0].wte.num_embeddings  # (the whole model: any stage knows it)
        elsewhere = [t for m, t in zip(held, (model[0].wte, model[-1].lm_head)) if m is None]
        self.loss_fn = chunk_vocabulary(*held, chunks, vocab, tp_group, elsewhere)
        if sp:
            sequence_parallel_between(*held, tp_group)
        if dp == "fsdp" and self.dp > 1:  # 3. dp: sharded weights; the sum is ours (shards.py)
            for block in blocks_of(stage):
                fully_shard(block, mesh=dp_mesh(mesh))
            fully_shard(stage, mesh=dp_mesh(mesh))
        self.grads = ShardGradients(stage, self.dp_group, shards)
        stage.register_forward_pre_hook(self.dropout.next_shard)
        self.schedule = None
        if pp > 1:  # 4. the shards are the microbatches, in order, as 1F1B runs them
            here = PipelineStage(stage, pp_rank, pp, torch.device("cpu"), group=self.pp_group)
            self.schedule = Schedule1F1B(here, self.here, loss_fn=self.loss_fn)
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1

    def mine(self, tensor):
        """This dp rank's run of shards of a global batch's rows."""
        rows = len(tensor) // self.dp
        return tensor[self.dp_rank * rows:(self.dp_rank + 1) * rows]

    def step(self, step, x, y):
        """Forward and backward of every shard of this dp rank, then the sum over dp: every
        weight's .grad is the mean over the global batch (x, y: its whole rows). Returns
        the step's loss (on the last stage; None elsewhere) and {name: whole gradient}."""
        self.dropout.start(step)
        x, y = self.mine(x), self.mine(y)
        losses = []
        if self.schedule is not None:
            self.schedule.step(*([x] if self.first else []), target=y if self.last else None,
                               losses=losses if self.last else None)
        else:
            for xs, ys in zip(x.chunk(self.here), y.chunk(self.here)):  # a backward a shard
                loss = self.loss_fn(self.stage(xs), ys)
                loss.backward()
                losses.append(loss.detach())
        whole = self.grads.reduce()  # the tree over shards, then over dp; / V
        loss = shard_loss(losses, self.dp_group, self.shards) if self.last else None
        return loss, whole

    def clip_grad_norm_(self, whole, max_norm):
        """Collective: every gradient scaled to a whole-model norm of at most max_norm."""
        order = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return clip_grad_norm_(self.stage, whole, order, max_norm, self.pp_group)
