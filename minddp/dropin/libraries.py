"""minddp's drop-ins beside stock's: the five calls a composition needs, picked by name.

    torchrun --nproc_per_node=4 examples/gpt_nd.py --mesh dp=2,tp=2 --impl stock

compose.py builds a model's parallelism from whichever set it is given, so one function
trains minddp's composition and stock's side by side (examples/gpt_nd.py, tests/test_mesh.py).
"""

from types import SimpleNamespace

from torch.distributed import pipelining as stock_pipelining
from torch.distributed.device_mesh import init_device_mesh as stock_mesh
from torch.distributed.fsdp import fully_shard as stock_fully_shard
from torch.distributed.tensor import parallel as stock_tp
from torch.nn.parallel import DistributedDataParallel

from .. import mesh as minddp_mesh, pp as minddp_pp, tp as minddp_tp
from .ddp import ManualDDP
from .fsdp import fully_shard

LIBRARIES = {
    "manual": SimpleNamespace(init_device_mesh=minddp_mesh.init_device_mesh, tp=minddp_tp,
                              fully_shard=fully_shard, DDP=ManualDDP, pipelining=minddp_pp),
    "stock": SimpleNamespace(init_device_mesh=stock_mesh, tp=stock_tp,
                             fully_shard=stock_fully_shard, DDP=DistributedDataParallel,
                             pipelining=stock_pipelining),
}
