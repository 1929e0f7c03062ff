"""The one job builder of the tests: a rank's model, dense optimizer, batches and, given a
root, checkpoint manager, built one way for every test.

Tests run their bodies on gloo ranks (see :mod:`tests.multiprocess`), where pytest
fixtures do not reach; they call :func:`make_job` there. A job's model is one of

- the app's DLRM on a list of :class:`~cnr_train.workload.TableSpec` (fused row-wise
  Adagrad, Zipf batches; its data reader's position is part of ``app_state``);
- ``"ebc"`` or ``"ec"``: TorchRec's ``TestSparseNN``, or a sequence model on an
  EmbeddingCollection, with a table of every layout (:mod:`tests.models`).

Batches depend only on the rank and the step, so two jobs see the same data whatever
their model seed, and a resumed job the data of an uninterrupted one. ``job.step(s)``
trains on step ``s``'s batch; ``job.train(n)`` on the next ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.optimizers import in_backward_optimizer_filter

from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer
from tests import models, reference
from torchrec_cnr import CheckpointConfig, CheckpointManager, QuantizeConfig
from torchrec_cnr.storage import Storage
from torchrec_cnr.tracking.tracker import TrackingMode


class Batches(Protocol):
    position: int

    def batch(self, rank: int, step: int) -> Any: ...


@dataclass
class Job:
    """One rank's model, dense optimizer, batches and (built with a root) manager."""

    model: DistributedModelParallel
    dense_opt: torch.optim.Optimizer
    data: Batches
    loss: Callable[[nn.Module, Any], torch.Tensor]
    manager: CheckpointManager | None = None
    saved_data: bool = False
    """Whether the data reader's position is part of ``app_state`` (the DLRM's is)."""

    @property
    def ckpt(self) -> CheckpointManager:
        assert self.manager is not None, "this job was built without a root"
        return self.manager

    @property
    def app_state(self) -> dict[str, Any]:
        app: dict[str, Any] = {"dense_opt": self.dense_opt}
        if self.saved_data:
            app = {"reader": self.data, **app}
        return app

    def step(self, step: int) -> None:
        """Trains on the batch of ``step``; the fused optimizer updates rows in backward."""
        batch = self.data.batch(dist.get_rank(), step)
        self.data.position = step
        self.dense_opt.zero_grad()
        self.loss(self.model, batch).backward()
        self.dense_opt.step()

    def train(self, steps: int) -> None:
        """Trains the next ``steps`` steps."""
        for _ in range(steps):
            self.step(self.data.position + 1)

    def run(
        self,
        first: int,
        last: int,
        refs: Path | str | None = None,
        ckpt: CheckpointManager | None = None,
    ) -> None:
        """Trains steps ``first`` to ``last``, each followed by ``maybe_save`` of ``ckpt``
        (the job's manager if ``None``; no saves without either); with ``refs``, keeps a
        reference of every saved step there (:mod:`tests.reference`)."""
        ckpt = ckpt if ckpt is not None else self.manager
        for step in range(first, last + 1):
            self.step(step)
            if ckpt is not None and ckpt.maybe_save(step) and refs is not None:
                save_reference(self, refs, step)

    def attach(self, root: str, storage: Storage | None = None, **config: Any) -> Job:
        """This job with a manager on ``root`` (``config``: :class:`CheckpointConfig`'s
        other fields)."""
        self.manager = CheckpointManager(
            self.model, CheckpointConfig(path=root, **config), self.app_state, storage=storage
        )
        return self


def _dlrm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch.dense, batch.sparse).squeeze(-1)
    return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)


def make_job(
    model: list[TableSpec] | str,
    root: str | None = None,
    *,
    seed: int,
    optimizer: str = "exact_rowwise_adagrad",
    layouts: dict[str, str] | None = None,
    data_seed: int = 0,
    batch_size: int = 16,
    alpha: float = 1.1,
    tracking_mode: TrackingMode = "bitmap",
    storage: Storage | None = None,
    dtensor: bool = False,
    delta_tracker: bool = False,
    **config: Any,
) -> Job:
    """A job on ``model`` (model seed ``seed``), with a manager on ``root`` if given.

    Args:
        model: the DLRM's tables, or ``"ebc"`` / ``"ec"`` (:mod:`tests.models`).
        root: the checkpoint root; ``config`` holds :class:`CheckpointConfig`'s other
            fields, ``storage`` replaces the root's storage (a
            :class:`tests.faults.FaultyStorage`).
        optimizer, layouts: for ``"ebc"`` / ``"ec"``: a key of
            :data:`tests.models.OPTIMIZERS`, and table name -> layout overriding each
            table's own (for resharding).
        data_seed, batch_size, alpha, tracking_mode: for the DLRM: its Zipf batches
            (which depend only on ``data_seed``, the rank and the step) and its tracker.
        dtensor: for ``"ebc"`` / ``"ec"``: a state dict of DTensors (``output_dtensor``).
        delta_tracker: for ``"ebc"`` / ``"ec"``: TorchRec's sharders and delta tracker
            instead of the library's sharders.
    """
    if isinstance(model, str):
        torch.manual_seed(seed)
        dmp, batches = models.sharded(model, optimizer, layouts, dtensor, delta_tracker)
        # Kernels initialise their tables from the global RNG; seed again per rank so
        # that two builds with one seed are identical.
        torch.manual_seed(seed + 1)
        # Adam, as TorchRec's examples use: its state appears lazily, and TestSparseNN has
        # a parameter that never gets a gradient, so a checkpoint holds no state for it.
        params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        job = Job(dmp, torch.optim.Adam(params, lr=0.01), batches, batches.loss)
    else:
        dmp = build_model(model, seed=seed, tracking_mode=tracking_mode)
        data = ZipfBatches(model, batch_size=batch_size, alpha=alpha, seed=data_seed)
        job = Job(dmp, dense_optimizer(dmp), data, _dlrm_loss, saved_data=True)
    if root is not None:
        job.attach(root, storage, **config)
    return job


def interval_config(
    root: str, policy: str, every: int, quant: dict[str, Any] | None = None, **config: Any
) -> CheckpointConfig:
    """A root's configuration: ``policy`` every ``every`` steps, ``quant`` as
    :class:`QuantizeConfig`'s fields (fp32 if ``None``), ``config`` the other fields."""
    quantize = QuantizeConfig(**(quant or {}))
    return CheckpointConfig(root, policy=policy, interval_steps=every, quantize=quantize, **config)  # type: ignore[arg-type]


def save_reference(job: Job, refs: Path | str, step: int) -> None:
    """This rank's whole state now, kept as the reference of ``step`` in ``refs``."""
    reference.save(reference.take(job.model, job.app_state), Path(refs), step)


def assert_restores(job: Job, refs: Path | str, step: int, latest: bool = False) -> None:
    """``job`` (a fresh one) restores ``step`` (the root's latest, which must be ``step``,
    if ``latest``) and then equals the reference kept when it was saved, on any sharding
    (the references of every rank are compared)."""
    assert job.ckpt.restore(step=None if latest else step) == step
    reference.assert_model_matches(job.model, job.app_state, reference.load_all(Path(refs), step))


def restores_exactly(
    model: list[TableSpec] | str,
    root: str,
    refs: Path | str,
    step: int,
    latest: bool = False,
    **job: Any,
) -> None:
    """On every rank: a fresh job on ``root`` (``model`` and ``job``: :func:`make_job`'s
    arguments) passes :func:`assert_restores`, then closes its manager."""
    fresh = make_job(model, root, **job)
    assert_restores(fresh, refs, step, latest)
    fresh.ckpt.close()


def assert_restore_refused(
    job: Job, error: type[Exception], needles: list[str], step: int | None = None
) -> None:
    """``job``'s restore of ``step`` (the latest if ``None``) raises ``error`` naming each
    of ``needles``, and leaves every local shard (weights, optimizer states and step
    counters), the dense state and ``app_state`` bit for bit as they were; then closes
    its manager."""
    before = models.capture(job.model, job.app_state)
    with pytest.raises(error) as info:
        job.ckpt.restore(step)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    after = models.capture(job.model, job.app_state)
    assert not models.differences(before, after), "a failed restore changed the model"
    job.ckpt.close()
