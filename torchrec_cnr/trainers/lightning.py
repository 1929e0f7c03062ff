"""A PyTorch Lightning callback that checkpoints a TorchRec model with a
:class:`~torchrec_cnr.CheckpointManager`: Lightning runs the loop, the manager saves.

How TorchRec and Lightning go together: the job starts its process group itself
(:func:`~torchrec_cnr.launch.init_distributed` under torchrun), builds the
``DistributedModelParallel`` model in the ``LightningModule``'s ``configure_model()`` and
trains with Lightning's ``ModelParallelStrategy``, which leaves the parallelism to the
module: it wraps nothing (``DDPStrategy`` would wrap the DMP model in DDP) and reuses a
process group that is already up. Turn Lightning's own checkpointing off
(``enable_checkpointing=False``): this callback saves instead.

At ``fit()``'s start it builds the manager over the module's DMP model and restores the
latest committed checkpoint: the model, its fused optimizer state, Lightning's optimizers
and LR schedulers, your ``app_state`` and the fit loop's progress (with the state of a
train dataloader that has ``state_dict()``/``load_state_dict()``), so that Lightning goes on
from the restored step. After each batch that stepped the optimizers it saves when
``trainer.global_step`` is due (``CheckpointConfig.interval_steps``), copy-on-write and
committed in the background; at the end it saves the last step if it was not saved, waits
for the commit and closes the manager.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel

from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.manager import CheckpointManager
from torchrec_cnr.trainers.session import CheckpointSession

__all__ = ["FIT_LOOP", "LightningCheckpointer"]

FIT_LOOP = "fit_loop"
"""The ``app_state`` name the fit loop's progress is saved under; Lightning's optimizers and
LR schedulers go under ``optimizer_<i>`` and ``lr_scheduler_<i>``."""


class _FitLoop:
    """The trainer's fit loop as ``app_state``: its progress and its dataloader's state."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state)


def _dmp_model(module: nn.Module) -> DistributedModelParallel:
    found = [m for m in module.modules() if isinstance(m, DistributedModelParallel)]
    if len(found) != 1:
        raise ValueError(
            f"LightningCheckpointer needs the LightningModule to hold one DistributedModelParallel "
            f"model (built in configure_model()), found {len(found)}: pass model= to name it"
        )
    return found[0]


class LightningCheckpointer(pl.Callback):
    """Checkpoints a TorchRec model from Lightning's ``Trainer.fit``.

    Args:
        config: where, when (``interval_steps``, in optimizer steps) and how; ``keep_last``
            keeps the latest N.
        app_state: what else to save and restore, each with ``state_dict()`` /
            ``load_state_dict()``; Lightning's optimizers, LR schedulers and fit loop are added.
        model: the ``DistributedModelParallel`` model; if ``None``, the one the
            ``LightningModule`` holds.
        pg: the model's process group; the default group if ``None``.
        save_last: save the last step at the end of training if the interval did not.

    Example::

        trainer = pl.Trainer(
            strategy=ModelParallelStrategy(), accelerator="cpu", devices=2, max_steps=1000,
            enable_checkpointing=False,
            callbacks=[LightningCheckpointer(CheckpointConfig(path="/ckpt/run1",
                                                              interval_steps=100, keep_last=3))],
        )
        trainer.fit(module, reader)
    """

    def __init__(
        self,
        config: CheckpointConfig,
        app_state: Mapping[str, Any] | None = None,
        model: nn.Module | None = None,
        pg: dist.ProcessGroup | None = None,
        save_last: bool = True,
    ) -> None:
        self._model = model
        self._session = CheckpointSession(config, app_state, pg, save_last)
        self._seen: int | None = None

    @property
    def manager(self) -> CheckpointManager | None:
        """The manager, from ``fit()``'s start to its end."""
        return self._session.manager

    @property
    def restored_step(self) -> int | None:
        """The step the last ``fit()`` resumed from (``None``: it started afresh)."""
        return self._session.restored_step

    def _lightning_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        state: dict[str, Any] = {FIT_LOOP: _FitLoop(trainer)}
        state.update({f"optimizer_{i}": o for i, o in enumerate(trainer.optimizers)})
        state.update(
            {f"lr_scheduler_{i}": c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)}
        )
        clash = sorted(state.keys() & self._session.app_state.keys())
        if clash:
            raise ValueError(f"app_state may not hold {clash}: Lightning's own state goes there")
        return state

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = self._model if self._model is not None else _dmp_model(pl_module)
        self._seen = self._session.begin(model, self._lightning_state(trainer))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        step = trainer.global_step
        if step == self._seen:  # the batch accumulated gradients: the optimizers did not step
            return
        self._seen = step
        self._session.step(step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._session.end(trainer.global_step)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._session.abort(exception)
