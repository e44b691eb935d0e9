"""Does the process group die in destroy_process_group()? A client's order, one process.

    python tests/scripts/group_outlives_destroy.py minddp-first   # 0 gloo threads after destroy
    python tests/scripts/group_outlives_destroy.py minddp-late    # 3 (2 on torch 2.11): it lives

The client creates its own group, then an optimizer (which imports torch._dynamo), wraps
the model in ManualDDP, trains a step and calls destroy_process_group() with the model
alive, as nanoGPT does. Then it counts this process's gloo threads: with minddp imported
before the group (at the top of the script) there are none; imported after it, the group
and its threads live on, to be freed at interpreter exit, where freeing them can abort.
"""

import gc
import sys

import torch
import torch.distributed as dist

if sys.argv[1] == "minddp-first":
    from minddp import ManualDDP
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.AdamW(model.parameters())  # imports torch._dynamo, if nobody did yet
from minddp import ManualDDP  # noqa: E402  (again, or for the first time: minddp-late)
model = ManualDDP(model)
model(torch.ones(2, 3)).sum().backward()
optimizer.step()
dist.destroy_process_group()
gc.collect()
from minddp.launch.teardown import group_threads  # noqa: E402
print(f"gloo threads after destroy_process_group(), model alive: {len(group_threads())}")
