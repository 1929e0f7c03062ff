"""What a checkpoint reads from and writes into a DistributedModelParallel model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from torchrec_cnr.tracking.shard import LocalShard
from torchrec_cnr.tracking.tracker import TRACKER_ATTR, RowTracker

_WRAPPERS = ("_dmp_wrapped_module", "module")


def _public_path(name: str) -> str:
    parts = [p for p in name.split(".") if p and p not in _WRAPPERS]
    return ".".join(parts)


def trackers(model: nn.Module) -> dict[str, RowTracker]:
    """Module path -> tracker, for every tracked sharded module in ``model``.

    Raises:
        ValueError: if the model has no tracked module, i.e. it was not sharded
            with :func:`torchrec_cnr.tracking_sharders`.
    """
    found = {}
    for name, module in model.named_modules():
        tracker = getattr(module, TRACKER_ATTR, None)
        if tracker is not None:
            found[_public_path(name)] = tracker
    if not found:
        raise ValueError(
            "model has no tracked embedding modules: pass torchrec_cnr.tracking_sharders() "
            "to the planner and to DistributedModelParallel"
        )
    return found


def local_shards(model: nn.Module) -> list[LocalShard]:
    """Every embedding shard this rank holds, with live views into its kernels."""
    shards = []
    for prefix, tracker in trackers(model).items():
        shards.extend(tracker.shards(prefix))
    return shards


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Replicated tensors of the model: dense parameters, buffers, data-parallel tables.

    The tensors share storage with the model, so ``copy_`` into them restores it.
    """
    return {
        key: value
        for key, value in model.state_dict().items()
        if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor)
    }
