"""Expert parallelism: experts on different ranks, tokens there and back by all_to_all.

    torchrun --nproc_per_node=2 examples/experts.py --grad-table runs/ep.txt
    pytest tests/test_experts.py tests/test_experts_example.py   # bitwise one process
    minddp ep-bench                   # tokens per expert, the all_to_alls' bytes

A mixture of experts sends each token to k of E expert MLPs. With the experts spread over
the ranks, each rank sends each token to the rank of its expert (all_to_all), the experts
run there, and a second all_to_all brings the outputs home.
Read in this order:
    experts.py   the layer in one process: the router, the experts, the combine
    parallel.py  the experts on ranks: counts, regroup, all_to_all and its backward
The examples: examples/experts.py, examples/break_experts.py. The docs page: docs/experts.md.
The exercise: minddp exercise experts DIR.
"""
