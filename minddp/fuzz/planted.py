"""Bugs planted in the invariant mode, one at a time, for the tests to prove the fuzzer finds them.

    pytest tests/test_fuzz.py -k planted     # each found, and after how many drawn cases

Each is a bug people hit in parallel trainers, written as a patch of one of minddp/invariant/'s
functions in the ranks that run a case (the lessons stay clean): `minddp fuzz --plant NAME`,
a switch only the tests use. None changes anything on one process, so each shows up only on
the meshes it breaks, as the real ones do:
  vocab-remainder  the vocabulary cut by tp ranks drops its remainder rows (vocabulary % tp:
                   Megatron-LM #1754's kind), and their tokens' logits with them
  bias-every-rank  a row split's bias added by every tp rank before the sum over tp
  local-loss       the loss averaged over a rank's own shards, not the global batch
  sp-norm-unsummed sequence parallel's LayerNorm gradients not summed over tp
  stage-residual   a stage one block longer than the others (blocks % pp) drops the residual
                   of its last block
"""

import torch.distributed as dist

from ..invariant import chunks, shards, step, tokens, vocab

PLANTS = ["vocab-remainder", "bias-every-rank", "local-loss", "sp-norm-unsummed",
          "stage-residual"]


def _size(group):
    if isinstance(group, (list, tuple)):  # the groups of a grid's dimensions: their product
        return _size(group[0]) * _size(group[1:]) if group else 1
    return 1 if group is None else dist.get_world_size(group)


def plant(name):
    """Patch the bug `name` into this process (None: none)."""
    if name == "vocab-remainder":  # the loss's rows: vocabulary // tp per rank, no more
        forward = vocab._VocabLoss.forward

        def dropping(ctx, h, targets, n, first, group, *weights):
            return forward(ctx, h, targets, n - n % _size(group), first, group, *weights)
        vocab._VocabLoss.forward = staticmethod(dropping)
    elif name == "bias-every-rank":
        add = chunks.add_bias
        chunks.add_bias = lambda y, bias, n, group, tp=None: add(y, bias * _size(_TP[0]), n,
                                                                group)
        _record_tp()
    elif name == "local-loss":
        init = shards.ShardGradients.__init__

        def local(self, stage, dp_group, count):
            init(self, stage, dp_group, count // _size(dp_group))
        shards.ShardGradients.__init__ = local
    elif name == "sp-norm-unsummed":
        tree = tokens.tree_sum
        tokens.tree_sum = lambda parts, group=None: tree(parts, None)
    elif name == "stage-residual":
        _drop_residual()
    elif name is not None:
        raise ValueError(f"no planted bug {name!r}: one of {', '.join(PLANTS)}")


_TP = [None]  # the tp group of the blocks being chunked (bias-every-rank)


def _record_tp():
    chunk_block = chunks.chunk_block

    def recorded(block, c, tp_group=None, *rest, **kwargs):
        _TP[0] = tp_group
        return chunk_block(block, c, tp_group, *rest, **kwargs)
    step.chunk_block = recorded


def _drop_residual():
    stage_layers = step.stage_layers

    def cut(model, index, count):
        stage = stage_layers(model, index, count)
        longest = max(len(stage_layers(model, i, count)) for i in range(count))
        shortest = min(len(stage_layers(model, i, count)) for i in range(count))
        blocks = [m for m in stage if hasattr(m, "attn")]
        if blocks and len(stage) == longest > shortest:  # the longer stage: its last block
            blocks[-1].register_forward_hook(lambda m, args, out: out - args[0])  # no residual
        return stage
    step.stage_layers = cut
