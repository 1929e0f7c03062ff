"""``interval_steps: auto``: measure the first checkpoint, then let CPR choose the interval.

The first checkpoint is taken at ``recovery.probe_step``. It measures the save stall,
the time to commit and the step time; :func:`choose_interval` turns them into the
recovery mode and interval (CPR, MLSys'21, Sec. 4.2), which every later manifest entry
records.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from torchrec_cnr.collectives import Collective
from torchrec_cnr.config import RecoveryConfig
from torchrec_cnr.recovery.interval import IntervalDecision, choose_interval

__all__ = ["IntervalProbe"]

logger = logging.getLogger(__name__)


class IntervalProbe:
    """Chooses the checkpoint interval from a measured first checkpoint.

    Args:
        config: CPR's inputs.
        group: the training ranks; each failure hits one of them (N in the PLS formula).
    """

    def __init__(self, config: RecoveryConfig, group: Collective) -> None:
        self.config = config
        self.group = group
        self.interval_steps: int | None = None
        """Steps between checkpoints, once chosen."""
        self.decision: IntervalDecision | None = None
        """The decision and its numbers, for the manifest."""
        self._first: tuple[int, float] | None = None

    def maybe_probe(self, step: int, save: Callable[[], object], wait: Callable[[], None]) -> bool:
        """Takes the probe checkpoint at ``recovery.probe_step``; returns whether it did.

        ``save`` starts a checkpoint of ``step`` and ``wait`` blocks until it is
        committed; both are collective.
        """
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        if step != self.config.probe_step:
            return False
        first_step, first_time = self._first
        began = time.perf_counter()
        save()
        stall = time.perf_counter() - began
        wait()
        commit = time.perf_counter() - began
        step_s, stall, commit = self.group.max(
            [(now - first_time) / max(step - first_step, 1), stall, commit]
        )
        rc = self.config
        decision = choose_interval(
            mtbf_s=rc.mtbf_s,
            num_shards=self.group.world_size,
            pls_target=rc.pls_target,
            save_cost_s=max(stall, 1e-6),
            load_cost_s=commit if rc.load_cost_s is None else rc.load_cost_s,
            reschedule_s=rc.reschedule_s,
        )
        self.interval_steps = max(1, round(decision.interval_s / step_s))
        self.decision = dataclasses.replace(
            decision, step_s=step_s, interval_steps=self.interval_steps
        )
        logger.warning(
            "interval auto: %s recovery, every %d steps (%.0f s); overhead partial %.4f%% vs "
            "full %.4f%%; save stall %.3f s, step %.4f s, MTBF %.0f s, %d shards, PLS %.4f",
            decision.mode,
            self.interval_steps,
            decision.interval_s,
            100 * decision.partial_overhead,
            100 * decision.full_overhead,
            stall,
            step_s,
            rc.mtbf_s,
            self.group.world_size,
            decision.pls,
        )
        return True
