"""When a job saves: every ``interval_steps`` steps, or at the interval CPR chooses.

With ``interval_steps="auto"`` the first checkpoint is the probe
(:class:`~torchrec_cnr.recovery.probe.IntervalProbe`) at ``recovery.probe_step``; its
measured cost sets the interval.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torchrec_cnr.collectives import Collective
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.recovery.interval import IntervalDecision
from torchrec_cnr.recovery.probe import IntervalProbe

__all__ = ["SaveSchedule"]


class SaveSchedule:
    """Decides at each step whether the job saves.

    Args:
        config: ``interval_steps`` (an int, ``"auto"`` or ``None``), ``recovery`` (CPR's
            inputs, for ``"auto"``) and ``on_busy``.
        group: the job's ranks.
    """

    def __init__(self, config: CheckpointConfig, group: Collective) -> None:
        self.interval_steps = config.interval_steps
        self.group = group
        self.on_busy = config.on_busy
        self.probe = IntervalProbe(config.recovery, group)
        self._last: int | None = None  # the step of the last save started (or restored)
        self._warned = False

    @property
    def decision(self) -> IntervalDecision | None:
        """CPR's choice and its numbers, once probed (every manifest entry records it)."""
        return self.probe.decision

    def maybe_save(self, step: int, save: Callable[[int], bool], wait: Callable[[], None]) -> bool:
        """Calls ``save(step)`` if ``step`` is due; returns whether it saved. Collective."""
        interval = self.interval_steps
        if interval is None and not self._warned:
            self._warned = True
            warnings.warn(
                "maybe_save() never saves: CheckpointConfig.interval_steps is None; set it "
                "to an int (or 'auto'), or call save(step) yourself",
                stacklevel=3,
            )
        if interval == "auto":
            if self.probe.interval_steps is None:
                return self.probe.maybe_probe(step, lambda: save(step), wait)
            interval = self.probe.interval_steps
        if not isinstance(interval, int) or step <= 0 or step == self._last:
            return False
        return step % interval == 0 and save(step)

    def saved(self, step: int) -> None:
        """Records that ``step`` was saved (or restored): it is not saved again."""
        self._last = step

    def skips(self, step: int, busy: str | None) -> bool:
        """Whether the save of ``step`` is skipped because a job still runs (``busy`` names
        it on this rank) and ``on_busy == "skip"``; collective, so every rank skips or none."""
        if self.on_busy != "skip" or not self.group.any(busy is not None):
            return False
        warnings.warn(
            f"checkpoint of step {step} skipped: the {busy or 'previous checkpoint'} is still "
            "being written (on_busy='skip'); its rows go into the next checkpoint",
            stacklevel=3,
        )
        return True
