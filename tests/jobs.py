"""The synthetic DLRM job most distributed tests run, built one way for all of them.

Tests run their bodies on gloo ranks (see :mod:`tests.multiprocess`), where pytest
fixtures do not reach; they call :func:`make_job` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel

from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer, train_step
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.storage import Storage
from torchrec_cnr.tracking.tracker import TrackingMode


@dataclass
class Job:
    """One rank's model, dense optimizer, data reader and checkpoint manager."""

    model: DistributedModelParallel
    opt: Any
    data: ZipfBatches
    ckpt: CheckpointManager

    @property
    def app(self) -> dict[str, Any]:
        return {"reader": self.data, "dense_opt": self.opt}

    def train(self, steps: int) -> None:
        """Trains ``steps`` steps on the reader's next batches."""
        for _ in range(steps):
            train_step(self.model, self.opt, self.data.next(dist.get_rank()))


def make_job(
    tables: list[TableSpec],
    root: str,
    *,
    seed: int,
    data_seed: int = 0,
    batch_size: int = 16,
    alpha: float = 1.1,
    tracking_mode: TrackingMode = "bitmap",
    storage: Storage | None = None,
    **config: Any,
) -> Job:
    """Builds the DLRM on ``tables`` (model seed ``seed``) with a manager on ``root``.

    Batches depend only on ``data_seed``, the rank and the step, so two jobs with one
    ``data_seed`` see the same data whatever their model seed. ``config`` holds the
    remaining :class:`CheckpointConfig` fields; ``storage`` replaces the root's storage
    (a :class:`tests.faults.FaultyStorage`).
    """
    model = build_model(tables, seed=seed, tracking_mode=tracking_mode)
    opt = dense_optimizer(model)
    data = ZipfBatches(tables, batch_size=batch_size, alpha=alpha, seed=data_seed)
    app = {"reader": data, "dense_opt": opt}
    return Job(
        model,
        opt,
        data,
        CheckpointManager(model, CheckpointConfig(path=root, **config), app, storage=storage),
    )
