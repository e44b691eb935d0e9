"""Elastic training: lose ranks or gain them, go on from the last checkpoint.

    torchrun --nnodes=1:2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --rdzv-id=job1 --max-restarts=3 examples/elastic.py --checkpoint-dir runs/elastic  # x2
    pytest tests/test_elastic.py               # 4 ranks resized to 1, 2, 3: the same weights

torchrun's elastic mode re-forms the group when a node leaves or joins; the training must
then go on at another world size. The batch is cut into a fixed number of shards whatever
the world size, and the shards' gradients are added in one fixed order, so a run resized
from 4 ranks to 1, 2 or 3 computes the same weights as a run never resized.
Read:
    resize.py  the sampler, the shards, the ordered sum, the checkpoint resharded
The example: examples/elastic.py. The docs page: docs/elastic.md.
"""
