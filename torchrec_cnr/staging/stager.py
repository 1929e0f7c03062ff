"""The stager: one save's rows, from the live shards into a finished staged checkpoint.

For each save it selects the rows (:mod:`torchrec_cnr.selection`), chooses for each
shard between copy-on-write (:mod:`.lazy`) and an eager copy (:mod:`.eager`), stages,
and restarts the shards' bits so that rows modified while the write runs go into the
next checkpoint. The choice, with its memory-budget rule (:func:`~.pool.staging_bytes`),
lives here and nowhere else; each shard that cannot be staged lazily is logged once,
with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from torchrec_cnr.config import CheckpointConfig, mb_bytes
from torchrec_cnr.selection.policy import Decision
from torchrec_cnr.selection.rows import (
    ClearedBits,
    restart_bits,
    select_recent,
    select_rows,
    tail_order,
)
from torchrec_cnr.snapshot.objects import serialize_app_state
from torchrec_cnr.staging.eager import stage
from torchrec_cnr.staging.lazy import LazyStaging, lazy_fallback
from torchrec_cnr.staging.pool import StagingPool, bits_buffer, staging_bytes
from torchrec_cnr.staging.shard import Sink, StagedCheckpoint
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

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

    Raises:
        ValueError: ``priority_budget_mb`` without shards that track priorities.
    """

    def __init__(
        self, shards: list[LocalShard], dense: Mapping[str, torch.Tensor], config: CheckpointConfig
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
        self.pool = StagingPool(budget, pin=on_gpu, compiled=config.io.compiled_staging)
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
        priority_bytes = self.priority_bytes
        lazy = self._lazy_shards(decision, priority_bytes is not None)
        eager = [i for i in range(len(self.shards)) if i not in lazy]
        self.lazy = None
        try:
            shards = [self.shards[i] for i in eager]
            rows = select_rows(shards, decision, priority_bytes)
            recent = select_recent(shards, decision, rows)
            rows = [tail_order(r, c) for r, c in zip(rows, recent)]
            keys = [f"s{i}" for i in eager]
            staged = stage(
                step, decision.kind, shards, rows, self.dense, app_state, self.pool, sink, recent, keys
            )  # fmt: skip
            if lazy:
                self.lazy = LazyStaging.begin(
                    [self.shards[i] for i in lazy], [f"s{i}" for i in lazy], decision, self.pool
                )
                staged.rest = self.lazy.run
                staged.staged_bytes += self.lazy.nbytes
            # Rows modified while the write runs belong to the next checkpoint.
            chosen = rows if priority_bytes is not None else None
            cleared = restart_bits(self.shards, decision, chosen, self._keep_bits)
        except Exception as e:
            self.detach()
            sink.abandon()
            return None, ClearedBits(), e
        staged.stall_s = time.perf_counter() - began
        return staged, cleared, None

    def _keep_bits(self, i: int, name: str, bits: torch.Tensor) -> torch.Tensor:
        """A copy of shard ``i``'s ``bits`` in a pooled buffer (see :func:`restart_bits`)."""
        key = bits_buffer(f"s{i}", name)
        return self.pool.take(key, tuple(bits.shape), bits.dtype, bits.device).copy_(bits)

    def _lazy_shards(self, decision: Decision, prioritized: bool) -> list[int]:
        """The shards this save stages lazily; it logs why others are not."""
        if not self.lazy_mode:
            return []
        if prioritized:
            self._say("prioritized saves (priority_budget_mb) choose their rows at save()")
            return []
        lazy: list[int] = []
        why: dict[str, list[str]] = {}
        for i, shard in enumerate(self.shards):
            reason = lazy_fallback(shard)
            if reason is None:
                lazy.append(i)
            else:
                why.setdefault(reason, []).append(shard.spec.table)
        for reason, tables in why.items():
            self._say(f"{', '.join(sorted(set(tables)))}: {reason}")
        budget = self.pool.budget_bytes
        if lazy and budget is not None:
            counts: list[int | None] = []
            for shard in self.shards:
                full = decision.kind == "full"
                counts.append(None if full or shard.words is None else bitmap.count(shard.words))
            need = staging_bytes(self.shards, counts)
            if need > budget:
                self._say(
                    f"this save needs {need / 2**20:.0f} MB of staging buffers, more than "
                    f"staging_memory_mb={self.memory_mb}: staged in chunks"
                )
                return []
        return lazy

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.info("staging eagerly (the stall grows with the checkpoint): %s", why)

    def detach(self) -> None:
        """Ends the last save's copy-on-write (its job is over, whatever happened to it)."""
        if self.lazy is not None:
            self.lazy.detach()

    def release(self) -> None:
        """Ends any copy-on-write and gives the staging buffers back."""
        self.detach()
        self.pool.release()
