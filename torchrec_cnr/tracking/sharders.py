"""Drop-in TorchRec sharders that attach a :class:`RowTracker` when they shard.

Pass them wherever TorchRec takes sharders: to the planner and to
``DistributedModelParallel``. They shard exactly as TorchRec's own sharders do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from torchrec_cnr.tracking.tracker import TRACKER_ATTR, RowTracker


def _attach(sharded: nn.Module, params: dict[str, ParameterSharding], env: ShardingEnv) -> None:
    types = {name: p.sharding_type for name, p in params.items()}
    setattr(sharded, TRACKER_ATTR, RowTracker(sharded, types, rank=env.rank))


class TrackingEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose sharded modules track modified rows."""

    def shard(
        self,
        module: Any,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        sharded = super().shard(module, params, env, device, module_fqn)
        _attach(sharded, params, env)
        return sharded


class TrackingEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` whose sharded modules track modified rows."""

    def shard(
        self,
        module: Any,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        sharded = super().shard(module, params, env, device, module_fqn)
        _attach(sharded, params, env)
        return sharded


def tracking_sharders(fused_params: dict[str, Any] | None = None) -> list[Any]:
    """Sharders for ``EmbeddingBagCollection`` and ``EmbeddingCollection`` that track rows.

    Args:
        fused_params: passed to TorchRec's sharders, e.g. the fused optimizer
            ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}``.

    Returns:
        A list to pass to the planner and to ``DistributedModelParallel``.

    Example::

        sharders = tracking_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
        plan = EmbeddingShardingPlanner(topology=topology).collective_plan(module, sharders, pg)
        model = DistributedModelParallel(module, plan=plan, sharders=sharders, device=device)
    """
    return [
        TrackingEmbeddingBagCollectionSharder(fused_params=fused_params),
        TrackingEmbeddingCollectionSharder(fused_params=fused_params),
    ]
