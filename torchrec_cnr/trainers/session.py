"""What every trainer callback does with the manager, whatever the trainer: build it and
restore the latest committed checkpoint at training's start, save each due step, save the
last step at the end and close, close on an exception."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.manager import CheckpointManager

__all__ = ["CheckpointSession"]

logger = logging.getLogger(__name__)


class CheckpointSession:
    """The manager's life in a trainer's callback; the callback calls :meth:`begin`,
    :meth:`step`, :meth:`end` and :meth:`abort` from the trainer's hooks.

    Args:
        config: where, when (``interval_steps``) and how.
        app_state: the user's ``app_state``; the trainer's own state is added at :meth:`begin`.
        pg: the model's process group; the default group if ``None``.
        save_last: save the last step at the end of training if the interval did not.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        app_state: Mapping[str, Any] | None,
        pg: dist.ProcessGroup | None,
        save_last: bool,
    ) -> None:
        self.config, self.pg, self.save_last = config, pg, save_last
        self.app_state = dict(app_state or {})
        self.manager: CheckpointManager | None = None
        """The manager, from training's start to its end."""
        self.restored_step: int | None = None
        """The step the last training resumed from (``None``: it started afresh)."""
        self._saved: int | None = None

    def begin(self, model: nn.Module, trainer_state: Mapping[str, Any]) -> int | None:
        """Builds the manager over ``model`` and restores the latest committed checkpoint
        into it, the user's ``app_state`` and ``trainer_state``; returns its step."""
        app = {**self.app_state, **trainer_state}
        self.manager = CheckpointManager(model, self.config, app, self.pg)
        self.restored_step = self._saved = self.manager.restore()
        return self.restored_step

    def step(self, step: int) -> None:
        """Saves ``step`` if it is due."""
        assert self.manager is not None
        if self.manager.maybe_save(step):
            self._saved = step

    def end(self, step: int) -> None:
        """Saves ``step`` if it was not saved (``save_last``), waits for the commit, closes."""
        manager, self.manager = self.manager, None
        assert manager is not None
        try:
            if self.save_last and step and step != self._saved:
                manager.save(step)
        finally:
            manager.close()

    def abort(self, exc: BaseException) -> None:
        """Closes the manager after training raised ``exc``: the checkpoint in flight
        commits and the root is released. A failure to close is logged, not raised: the
        trainer raises ``exc`` next."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        try:
            manager.close()
        except Exception as e:
            logger.error("closing the checkpoint manager after %r failed: %s", exc, e)
