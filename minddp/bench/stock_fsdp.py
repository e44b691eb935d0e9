"""Stock fully_shard's private internals, read here and nowhere else (the FSDP benchmark's).

    minddp fsdp-bench --world-sizes 2 --sizes 0.3M --rounds 2

The memory columns need two things stock's public API does not show: when a unit's
all_gather has landed (FSDPParamGroup.wait_for_unshard) and the whole weights it filled
(FSDPParam._unsharded_param). Both are private names of torch 2.13's FSDP2; a release that
moves them gets one line naming what moved, not a wrong figure.
"""

from ..launch.usage_error import UsageError

_WHERE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def _moved(what):
    import torch
    return UsageError(f"torch {torch.__version__} moved stock fully_shard's private {what},"
                      " which the FSDP benchmark's memory columns read",
                      hint="run it with torch 2.13, or update minddp/bench/stock_fsdp.py")


def unshard_done_method():
    """(class, method name) of the call that returns once a stock unit's all_gather landed."""
    try:
        import importlib
        group = importlib.import_module(_WHERE).FSDPParamGroup
    except (ImportError, AttributeError):
        raise _moved(f"{_WHERE}.FSDPParamGroup") from None
    if not hasattr(group, "wait_for_unshard"):
        raise _moved("FSDPParamGroup.wait_for_unshard")
    return group, "wait_for_unshard"


def whole_weights(model):
    """The tensors stock's units fill with whole weights at each all_gather."""
    tensors = []
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", []) if group else []:
            if not hasattr(fp, "_unsharded_param"):
                raise _moved("FSDPParam._unsharded_param")
            tensors.append(fp._unsharded_param)
    if not tensors and any(hasattr(m, "_get_fsdp_state") for m in model.modules()):
        raise _moved("FSDPState._fsdp_param_group")
    return tensors
