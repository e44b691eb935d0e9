"""A communication hook written out: what DDP does with one bucket, in a few lines.

    minddp bench --contenders bucketed "bucketed fp16" stock "stock fp16"

A comm hook replaces DDP's "all_reduce this bucket" with your own function:
hook(state, bucket) -> Future[Tensor], where the future's tensor is the reduced bucket.
Register it on stock DDP or ManualDDP alike: model.register_comm_hook(group, fp16_mean_hook).
This one sends each bucket in float16, half the bytes on the wire, and gives gradients
bitwise equal to PyTorch's own fp16_compress_hook (tests/test_contract.py).
"""

import torch
import torch.distributed as dist

from ..launch.usage_error import UsageError


def fp16_mean_hook(group, bucket):
    """Average a bucket over ranks, sending it as float16."""
    buffer = bucket.buffer()  # float32, this rank's gradients, not yet divided
    # Divide before summing: a float16 holds at most 65504, and a sum of large
    # gradients over many ranks would overflow where the mean does not.
    world_size = dist.get_world_size(group)
    sent = buffer.to(torch.float16).div_(world_size)
    future = dist.all_reduce(sent, group=group, async_op=True).get_future()

    def back_to_float32(future):
        # Runs when the all_reduce completes; its result becomes the bucket's.
        buffer.copy_(future.value()[0])  # float16 -> float32, into the bucket itself
        return buffer

    return future.then(back_to_float32)


def hook_result(hook, returned, position, flat):
    """The reduced bucket from what a hook returned; a clear error if it is not one."""
    name = getattr(hook, "__qualname__", repr(hook))
    if not isinstance(returned, torch._C.Future):  # torch.futures.Future's base
        raise UsageError(f"comm hook {name} returned {type(returned).__name__}, not a"
                         f" torch.futures.Future",
                         hint="return the future of an async collective,"
                              " e.g. dist.all_reduce(t, async_op=True).get_future()")
    result = returned.wait()
    if isinstance(result, list) and len(result) == 1:
        result = result[0]  # an all_reduce's future holds [tensor]
    if not isinstance(result, torch.Tensor) or result.numel() != flat.numel():
        got = f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor) \
            else type(result).__name__
        raise UsageError(f"comm hook {name} must give a tensor of bucket {position}'s"
                         f" {flat.numel()} elements, it gave {got}",
                         hint="return a future whose value is the reduced bucket.buffer()")
    return result.to(flat.dtype)
