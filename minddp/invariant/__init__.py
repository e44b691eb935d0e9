"""The invariant mode: one program, the same bits on any mesh, the same as one process.

    python examples/gpt_nd.py --invariant --mesh dp=1 --grad-table runs/one.txt
    torchrun --nproc_per_node=4 examples/gpt_nd.py --invariant --mesh pp=2,tp=2 --untied \\
        --grad-table runs/pp2tp2.txt
    minddp diff runs/pp2tp2.txt runs/one.txt        # IDENTICAL, element for element
    pytest tests/test_invariant.py                  # the meshes of 1, 2 and 4 ranks

Every chapter so far is proved bit for bit against stock's same configuration. Two
configurations of one model (another dp, tp on, one more stage) still differ in the last
bits, and the question every user of a parallel trainer asks, "bug or rounding?", has no
answer from bits that differ anyway. Here every sum whose order a mesh chooses is given one
order instead, so a difference between two meshes is a bug, never rounding.
Read in this order:
    step.py    the lesson: the step's sums, each mesh's order and the fixed one; the training
    tree.py    one order for a sum: a pairwise tree over a fixed number of leaves
    shards.py  the batch in virtual shards, each its own backward; the sum over dp; dropout
    chunks.py  tensor parallelism in chunks, the same chunks at every tp
    tokens.py  the sums over tokens (LayerNorms, a row split's bias); sequence parallel
    vocab.py   the vocabulary in chunks: the embedding, the loss's softmax, its gradient
    clip.py    the clip's norm from whole gradients, in the model's order
    experts.py expert parallelism: an expert's gradient a shard at a time, any ep
    plan.py    what the mode asks of a mesh, refused in one line before any group
The examples: examples/gpt_nd.py --invariant (examples/break_invariant.py turns one order
off), examples/experts.py --invariant. The docs page: docs/invariant.md, with the price of
each order, measured.
"""
