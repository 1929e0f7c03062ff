"""A save's plan: every decision about one checkpoint's shards, made once, before any copy.

:func:`plan_save` decides, for each shard, what the checkpoint stores of it and how it is
staged:

- ``lazy``: copy-on-write (:mod:`.lazy`); the rows are those set in the shard's bitmap
  when :class:`~.lazy.LazyStaging` snapshots it, right after the plan.
- ``eager``: copied during ``save()`` (:mod:`.eager`), its rows chosen here
  (:func:`~torchrec_cnr.selection.rows.select_rows`).
- ``chunked``: copied during ``save()`` a budget's worth at a time, each chunk written
  before the next is copied: the checkpoint does not fit ``staging_memory_mb``.

The budget rule (:func:`~.pool.staging_bytes` against the pool's budget) is applied here
and nowhere else: a checkpoint that does not fit is chunked whole; one that fits stages
each shard lazily where the shard allows it (:func:`~.lazy.lazy_fallback`), eagerly
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from torchrec_cnr.schema import shard_key
from torchrec_cnr.selection.policy import Decision
from torchrec_cnr.selection.rows import select_recent, select_rows, stored_count, tail_order
from torchrec_cnr.staging.pool import staging_bytes
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["SavePlan", "ShardPlan", "Strategy", "plan_save"]

Strategy = Literal["lazy", "eager", "chunked"]


@dataclass
class ShardPlan:
    """What one checkpoint stores of one shard, and how it is staged."""

    shard: LocalShard
    key: str
    strategy: Strategy
    rows: torch.Tensor | None = None
    """``eager`` and ``chunked``: the ``(k,)`` local rows stored, in the order they are
    stored (:func:`~torchrec_cnr.selection.rows.tail_order`); ``None``: every row. ``lazy``:
    ``None``, the rows come from the bitmap's snapshot."""
    recent: torch.Tensor | None = None
    """``eager`` and ``chunked``: the ``(k,)`` local rows among those stored that changed
    since the last checkpoint, where they are not all of them."""
    count: int | None = None
    """Rows stored, where known before staging (``None``: every row, or a lazy shard's,
    counted only where a budget asks)."""

    @property
    def tail(self) -> bool:
        """The stored rows end with ``recent``'s (a follower reads them in one run)."""
        r, c = self.rows, self.recent
        return (
            r is not None
            and c is not None
            and c.numel() <= r.numel()
            and bool(torch.equal(r[r.numel() - c.numel() :], c))
        )


@dataclass
class SavePlan:
    """Every shard's :class:`ShardPlan` for one checkpoint."""

    step: int
    decision: Decision
    shards: list[ShardPlan]
    nbytes: int | None
    """Bytes of staging buffers the checkpoint takes, where a budget asked for them."""

    def staged(self, *strategies: Strategy) -> list[ShardPlan]:
        """The shards staged with one of ``strategies``, in shard order."""
        return [p for p in self.shards if p.strategy in strategies]

    @property
    def chosen(self) -> list[torch.Tensor | None]:
        """Each shard's rows as chosen at the save (CPR's prioritized rows)."""
        return [p.rows for p in self.shards]


def plan_save(
    step: int,
    shards: list[LocalShard],
    decision: Decision,
    lazy: list[bool],
    budget_bytes: int | None,
    priority_bytes: int | None = None,
) -> SavePlan:
    """The plan of a checkpoint of ``shards`` at ``step``; call with every lookup so far in
    the bits (``shard.drain()``).

    Args:
        lazy: for each shard, whether it may be staged lazily (the staging mode and
            :func:`~.lazy.lazy_fallback` allow it, and the rows are not CPR's
            prioritized ones, which are chosen at the save).
        budget_bytes: the most bytes of staging buffers a save holds (``None``: no bound).
        priority_bytes: CPR's prioritized saves: a delta holds the highest-priority
            modified rows up to this many bytes.
    """
    plans = [
        ShardPlan(s, shard_key(i), "lazy" if ok else "eager")
        for i, (s, ok) in enumerate(zip(shards, lazy))
    ]
    _choose(plans, decision, "eager", priority_bytes)
    need = None
    if budget_bytes is not None:
        for p in plans:
            if p.strategy == "lazy" and decision.kind != "full" and p.shard.words is not None:
                p.count = stored_count(p.shard, bitmap.count(p.shard.words))
        need = staging_bytes([p.shard for p in plans], [p.count for p in plans])
        if need > budget_bytes:
            _choose(plans, decision, "lazy", priority_bytes)
            for p in plans:
                p.strategy = "chunked"
    return SavePlan(step, decision, plans, need)


def _choose(
    plans: list[ShardPlan], decision: Decision, strategy: Strategy, priority_bytes: int | None
) -> None:
    """Chooses the rows of the shards planned with ``strategy``."""
    chosen = [p for p in plans if p.strategy == strategy]
    shards = [p.shard for p in chosen]
    rows = select_rows(shards, decision, priority_bytes)
    recent = select_recent(shards, decision, rows)
    for p, r, c in zip(chosen, rows, recent):
        p.rows, p.recent = tail_order(r, c), c
        p.count = None if r is None else r.numel()
