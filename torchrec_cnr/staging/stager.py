"""The stager: one save's rows, from the live shards into a finished staged checkpoint.

For each save it makes the plan (:mod:`.plan`: the rows of each shard, and whether it is
staged by copy-on-write, :mod:`.lazy`, or copied at once, :mod:`.eager`), stages as
planned, and restarts the shards' bits so that rows modified while the write runs go into
the next checkpoint. Each shard that cannot be staged lazily is logged once, with the
reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.selection.policy import Decision
from torchrec_cnr.selection.rows import ClearedBits, put_back_bits, restart_bits
from torchrec_cnr.snapshot.objects import serialize_app_state
from torchrec_cnr.staging.eager import stage
from torchrec_cnr.staging.lazy import LazyStaging, lazy_fallback
from torchrec_cnr.staging.plan import SavePlan, plan_save, shard_key
from torchrec_cnr.staging.pool import StagingPool, bits_buffer
from torchrec_cnr.staging.shard import Sink, StagedCheckpoint
from torchrec_cnr.staging.shared import SharedBuffers
from torchrec_cnr.tracking.shard import LocalShard
from torchrec_cnr.units import mb_bytes

__all__ = ["Stager"]

logger = logging.getLogger(__name__)


class Stager:
    """Stages the saves of one set of shards into buffers it owns.

    Args:
        shards: this rank's shards.
        dense: the dense tensors a save copies.
        config: ``staging`` (lazy where a shard allows it, or eager), ``staging_memory_mb``
            (most host memory for staged rows), ``io.compiled_staging`` (the compiled
            copier) and ``priority_budget_mb`` (CPR's prioritized saves: deltas hold the
            highest-priority modified rows up to this many MB, chosen and staged at the save).

        shared: where host buffers come from with ``background="process"`` (see
            :mod:`.shared`).

    Raises:
        ValueError: ``priority_budget_mb`` without shards that track priorities.
    """

    def __init__(
        self,
        shards: list[LocalShard],
        dense: Mapping[str, torch.Tensor],
        config: CheckpointConfig,
        shared: SharedBuffers | None = None,
    ) -> None:
        priority_mb = config.priority_budget_mb
        if priority_mb is not None and any(s.priority is None for s in shards):
            raise ValueError("priority_budget_mb needs tracking_sharders(mode='mfu' or 'ssu')")
        self.priority_bytes = mb_bytes(priority_mb)
        self.shards = shards
        self.dense = dense
        self.lazy_mode = config.staging == "lazy"
        self.memory_mb = config.staging_memory_mb
        on_gpu = any(s.weight.device.type == "cuda" for s in shards)
        budget = mb_bytes(self.memory_mb)
        pin = on_gpu and shared is None
        self.pool = StagingPool(budget, pin, config.io.compiled_staging, shared)
        # So that the first save stalls no longer than the others: the buffers of a full
        # checkpoint faulted in, and torch.save's imports (done on its first call) done.
        self.pool.prefault(shards, dense)
        serialize_app_state({})
        self.lazy: LazyStaging | None = None
        """The copy-on-write of the last save (``None`` if it staged every row eagerly):
        its ``hook_rows``, ``hook_s`` and ``background_s`` tell who copied what."""
        self._said: set[str] = set()

    def stage(
        self, step: int, decision: Decision, app_state: Mapping[str, Any], sink: Sink
    ) -> tuple[StagedCheckpoint | None, ClearedBits, Exception | None]:
        """Stages a checkpoint of ``step`` into ``sink`` and restarts the shards' bits.

        Returns:
            The staged checkpoint (its ``stall_s`` set), the bits it cleared (put back if
            its write fails), and why staging failed on this rank, if it did (a NaN row:
            the sink is abandoned, and every rank learns of it at the commit).
        """
        began = time.perf_counter()
        # Every lookup so far into the bits (the tracker marks them on a thread of its own)
        # before any bit is read or cleared: lazy staging snapshots them unselected.
        for shard in self.shards:
            shard.drain()
        self.lazy = None
        cleared = ClearedBits()
        try:
            plan = self.plan(step, decision)
            staged = stage(plan, self.dense, app_state, self.pool, sink)
            lazy = plan.staged("lazy")
            if lazy:
                self.lazy = LazyStaging.begin(lazy, decision, self.pool)
                staged.rest = self.lazy.run
                staged.staged_bytes += self.lazy.nbytes
            # Rows modified while the write runs belong to the next checkpoint.
            chosen = plan.chosen if self.priority_bytes is not None else None
            restart_bits(self.shards, decision, chosen, self._keep_bits, cleared)
        except BaseException as e:  # an interrupt too: nothing staged, no bit lost
            self.withdraw(sink, cleared)
            if not isinstance(e, Exception):
                raise
            return None, ClearedBits(), e
        staged.stall_s = time.perf_counter() - began
        return staged, cleared, None

    def plan(self, step: int, decision: Decision) -> SavePlan:
        """The plan of this save (:func:`~.plan.plan_save`); logs why shards are not lazy."""
        plan = plan_save(step, self.shards, decision, self._lazy_allowed(),
                         self.pool.budget_bytes, self.priority_bytes)  # fmt: skip
        if plan.nbytes is not None and plan.staged("chunked"):
            self._say(
                f"this save needs {plan.nbytes / 2**20:.0f} MB of staging buffers, more than "
                f"staging_memory_mb={self.memory_mb}: staged in chunks"
            )
        return plan

    def _keep_bits(self, i: int, name: str, bits: torch.Tensor) -> torch.Tensor:
        """A copy of shard ``i``'s ``bits`` in a pooled buffer (see :func:`restart_bits`)."""
        key = bits_buffer(shard_key(i), name)
        return self.pool.take(key, tuple(bits.shape), bits.dtype, bits.device).copy_(bits)

    def _lazy_allowed(self) -> list[bool]:
        """For each shard, whether this save may stage it lazily; logs why not."""
        if not self.lazy_mode:
            return [False] * len(self.shards)
        if self.priority_bytes is not None:
            self._say("prioritized saves (priority_budget_mb) choose their rows at save()")
            return [False] * len(self.shards)
        allowed: list[bool] = []
        why: dict[str, list[str]] = {}
        for shard in self.shards:
            reason = lazy_fallback(shard)
            allowed.append(reason is None)
            if reason is not None:
                why.setdefault(reason, []).append(shard.spec.table)
        for reason, tables in why.items():
            self._say(f"{', '.join(sorted(set(tables)))}: {reason}")
        return allowed

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.info("staging eagerly (the stall grows with the checkpoint): %s", why)

    def withdraw(self, sink: Sink, cleared: ClearedBits) -> None:
        """Takes back a staging that no job will write (it failed, or was cut short): ends
        its copy-on-write, abandons ``sink`` and ORs back the bits it ``cleared``."""
        self.detach()
        sink.abandon()
        put_back_bits(self.shards, cleared)

    def detach(self) -> None:
        """Ends the last save's copy-on-write (its job is over, whatever happened to it)."""
        if self.lazy is not None:
            self.lazy.detach()

    def release(self) -> None:
        """Ends any copy-on-write and gives the staging buffers back."""
        self.detach()
        self.pool.release()
