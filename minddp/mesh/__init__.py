"""The mesh: every parallelism on one grid of ranks (PP x FSDP x TP, torchtitan's order).

    torchrun --nproc_per_node=8 examples/gpt_nd.py --mesh pp=2,dp=2,tp=2 --untied
    pytest tests/test_mesh.py tests/test_capstone.py   # the groups; every mesh against stock's

The world as a grid of named dimensions: each dimension a set of groups, one per line of the
grid, each rank in one group of every dimension. On it the earlier chapters compose: the
pipeline cuts the model into stages, tensor parallelism splits each layer, FSDP shards
what is left over the data-parallel ranks, and clipping needs one norm of the whole.
Read in this order:
    device_mesh.py  DeviceMesh and init_device_mesh by hand: the grid's groups, a rank's place
    plan.py         what a mesh asks of a model, checked before any group exists
    compose.py      every parallelism on one mesh, as torchtitan applies them
    clip.py         gradient clipping on a mesh: each part of the norm counted once
The example: examples/gpt_nd.py. The docs page: docs/mesh.md. The exercises: minddp exercise
mesh|clip DIR.
"""
