"""A torchtnt callback that checkpoints a TorchRec model with a
:class:`~torchrec_cnr.CheckpointManager`: torchtnt runs the loop, the manager saves.

At ``train()``'s start it builds the manager and restores the latest committed checkpoint
(the model, its optimizer state, your ``app_state`` and the unit's train progress, so that
torchtnt goes on from the restored step); after each train step it saves when the step is
due (``CheckpointConfig.interval_steps``), copy-on-write and committed in the background;
at the end it saves the last step if it was not saved, waits for the commit and closes the
manager. ``keep_last`` keeps the latest checkpoints' chains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.unit import TTrainUnit

from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.trainers.session import CheckpointSession

__all__ = ["PROGRESS", "TorchtntCheckpointer"]

PROGRESS = "train_progress"
"""The ``app_state`` name the unit's train progress is saved under."""


class TorchtntCheckpointer(Callback):
    """Checkpoints ``model`` from torchtnt's ``train()``.

    Args:
        model: the ``DistributedModelParallel`` model the unit trains (sharded with
            :func:`~torchrec_cnr.tracking_sharders`).
        config: where, when (``interval_steps``) and how; ``keep_last`` keeps the latest N.
        app_state: what else to save and restore (the data reader, the dense optimizer),
            each with ``state_dict()`` / ``load_state_dict()``; the unit's train progress is
            added as :data:`PROGRESS`.
        pg: the model's process group; the default group if ``None``.
        save_last: save the last step at the end of training if the interval did not.

    Example::

        checkpointer = TorchtntCheckpointer(
            model, CheckpointConfig(path="/ckpt/run1", interval_steps=100, keep_last=3),
            app_state={"reader": reader, "dense_opt": dense_optimizer},
        )
        train(unit, reader, max_steps=1000, callbacks=[checkpointer])
    """

    def __init__(
        self,
        model: nn.Module,
        config: CheckpointConfig,
        app_state: Mapping[str, Any] | None = None,
        pg: dist.ProcessGroup | None = None,
        save_last: bool = True,
    ) -> None:
        if PROGRESS in (app_state or {}):
            raise ValueError(f"app_state may not hold {PROGRESS!r}: the unit's progress goes there")
        self._model = model
        self._session = CheckpointSession(config, app_state, pg, save_last)

    @property
    def manager(self) -> CheckpointManager | None:
        """The manager, from ``train()``'s start to its end."""
        return self._session.manager

    @property
    def restored_step(self) -> int | None:
        """The step the last ``train()`` resumed from (``None``: it started afresh)."""
        return self._session.restored_step

    def on_train_start(self, state: State, unit: TTrainUnit) -> None:
        self._session.begin(self._model, {PROGRESS: unit.train_progress})

    def on_train_step_end(self, state: State, unit: TTrainUnit) -> None:
        self._session.step(unit.train_progress.num_steps_completed)

    def on_train_end(self, state: State, unit: TTrainUnit) -> None:
        self._session.end(unit.train_progress.num_steps_completed)

    def on_exception(self, state: State, unit: Any, exc: BaseException) -> None:
        self._session.abort(exc)
