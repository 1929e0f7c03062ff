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

from torchrec_cnr.tracking.tracker import TRACKER_ATTR, RowTracker, TrackingMode


def _attach(
    sharded: nn.Module,
    params: dict[str, ParameterSharding],
    env: ShardingEnv,
    options: dict[str, Any],
) -> None:
    types = {name: p.sharding_type for name, p in params.items()}
    setattr(sharded, TRACKER_ATTR, RowTracker(sharded, types, rank=env.rank, **options))


class TrackingEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose sharded modules track modified rows."""

    tracking_options: dict[str, Any] = {}  # noqa: RUF012 - replaced per instance by tracking_sharders()

    def shard(
        self,
        module: Any,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        sharded = super().shard(module, params, env, device, module_fqn)
        _attach(sharded, params, env, self.tracking_options)
        return sharded


class TrackingEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` whose sharded modules track modified rows."""

    tracking_options: dict[str, Any] = {}  # noqa: RUF012 - replaced per instance by tracking_sharders()

    def shard(
        self,
        module: Any,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        sharded = super().shard(module, params, env, device, module_fqn)
        _attach(sharded, params, env, self.tracking_options)
        return sharded


def tracking_sharders(
    fused_params: dict[str, Any] | None = None,
    mode: TrackingMode = "bitmap",
    ssu_rate: float = 0.1,
) -> list[Any]:
    """Sharders for ``EmbeddingBagCollection`` and ``EmbeddingCollection`` that track rows.

    Args:
        fused_params: passed to TorchRec's sharders, e.g. the fused optimizer
            ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}``.
        mode: ``bitmap`` (modified rows), ``mfu`` (also an access count per
            row) or ``ssu`` (also the rows a ``ssu_rate`` subsample touched),
            for CPR's prioritized saves.
        ssu_rate: sampling rate of ``ssu``.

    Returns:
        A list to pass to the planner and to ``DistributedModelParallel``.

    Example::

        sharders = tracking_sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
        plan = EmbeddingShardingPlanner(topology=topology).collective_plan(module, sharders, pg)
        model = DistributedModelParallel(module, plan=plan, sharders=sharders, device=device)
    """
    sharders: list[Any] = [
        TrackingEmbeddingBagCollectionSharder(fused_params=fused_params),
        TrackingEmbeddingCollectionSharder(fused_params=fused_params),
    ]
    for sharder in sharders:
        sharder.tracking_options = {"mode": mode, "ssu_rate": ssu_rate}
    return sharders
