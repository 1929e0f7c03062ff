"""Which rows of each local shard a checkpoint holds, and when their bits restart.

Check-N-Run (NSDI'22, Sec. 4.2-4.3): a baseline holds every row; a delta holds the rows
whose bit is set. Bits restart when a checkpoint is staged: at every checkpoint for
``consecutive``, at baselines only for the cumulative policies. Rows modified while the
write runs belong to the next checkpoint. If the write fails, the bits it cleared are
put back, so that no update drops out of the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchrec_cnr.selection.policy import ChainState, Decision, Policy
from torchrec_cnr.selection.priority import prioritize
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

__all__ = [
    "ClearedBits",
    "put_back_bits",
    "recent_rows",
    "recorded_recent",
    "restart_bits",
    "resume_chain",
    "select_recent",
    "select_rows",
    "stored_count",
    "tail_order",
]


def select_rows(
    shards: list[LocalShard], decision: Decision, budget_bytes: int | None = None
) -> list[torch.Tensor | None]:
    """For each shard, the ``(k,)`` ascending local rows the checkpoint holds.

    ``None`` stands for every row: a baseline, a kernel whose every row counts as
    modified, or a delta that happens to hold every row. With ``budget_bytes`` a delta
    holds CPR's prioritized rows (see :func:`prioritize`). Call it with every lookup so
    far in the bits (``shard.drain()``: the stager drains every shard first).
    """
    if decision.kind == "full":
        return [None] * len(shards)
    if budget_bytes is not None:
        picked: list[torch.Tensor | None] = list(prioritize(shards, budget_bytes))
    else:
        picked = [
            None if s.words is None else bitmap.to_indices(s.words, s.spec.rows) for s in shards
        ]
    return [
        None if rows is None or stored_count(s, rows.numel()) is None else rows
        for s, rows in zip(shards, picked)
    ]


def stored_count(shard: LocalShard, selected: int) -> int | None:
    """Rows a checkpoint stores of ``shard`` when ``selected`` of them are chosen: ``None``
    where that is every row, stored as a baseline stores it (without ids)."""
    return None if selected == shard.spec.rows else selected


def select_recent(
    shards: list[LocalShard], decision: Decision, rows: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """For each shard, the ``(k,)`` ascending local rows modified since the last checkpoint
    among those this one stores; ``None`` where that is every stored row.

    A serving follower reads these to catch up by one checkpoint. A consecutive delta
    stores exactly them; a cumulative delta or a baseline stores more.

    Args:
        rows: what :func:`select_rows` chose for each shard.
    """
    out: list[torch.Tensor | None] = []
    for shard, stored in zip(shards, rows):
        recent = recorded_recent(shard, decision)
        whole = shard.spec.rows if stored is None else stored.numel()
        out.append(None if recent is None else recent_rows(recent, shard.spec.rows, whole))
    return out


def tail_order(rows: torch.Tensor | None, recent: torch.Tensor | None) -> torch.Tensor | None:
    """``rows`` (ascending local rows a delta stores) in the order it stores them: those
    not in ``recent`` first, then ``recent``'s, each run ascending (a ``tail`` record), so
    that a follower reads the rows changed since the previous checkpoint in one run.
    ``rows`` as they are where there is no such tail (``recent`` is ``None``, or not all
    stored)."""
    if rows is None or recent is None or recent.numel() == 0:
        return rows
    at = torch.searchsorted(rows, recent).clamp_max(rows.numel() - 1)
    if not bool(torch.equal(rows[at], recent)):
        return rows
    stale = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
    stale[at] = False
    return torch.cat([rows[stale], recent])


def recorded_recent(shard: LocalShard, decision: Decision) -> torch.Tensor | None:
    """``shard``'s bitmap of rows changed since the last checkpoint, if a checkpoint of
    ``decision`` records them apart from its stored rows: not where every row counts as
    changed, nor in a consecutive delta, which stores exactly them."""
    return None if decision.kind == "delta" and decision.clear_bits else shard.recent


def recent_rows(recent: torch.Tensor, num_rows: int, stored: int) -> torch.Tensor | None:
    """The ``(k,)`` local rows set in the ``recent`` bitmap; ``None`` if they are all
    ``stored`` rows of the checkpoint."""
    changed = bitmap.to_indices(recent, num_rows)
    return None if changed.numel() == stored else changed


@dataclass
class ClearedBits:
    """Each tracked shard's bits as they were before a checkpoint cleared them."""

    words: list[torch.Tensor] = field(default_factory=list)
    """The policy's bits, if this checkpoint cleared them."""
    recent: list[torch.Tensor] = field(default_factory=list)
    """The bits of rows modified since the previous checkpoint (every checkpoint clears them)."""


def restart_bits(
    shards: list[LocalShard],
    decision: Decision,
    prioritized: list[torch.Tensor | None] | None,
    keep: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None,
    cleared: ClearedBits | None = None,
) -> ClearedBits:
    """Clears the bits (and CPR priorities) of the rows the staged checkpoint covers, and
    every shard's bits of rows modified since the previous checkpoint.

    Args:
        shards: the local shards.
        decision: the staged checkpoint's decision.
        prioritized: the rows a prioritized delta holds; only their bits clear, the
            others wait for the next checkpoint. ``None`` clears every bit.
        keep: ``keep(i, name, bits)`` copies shard ``i``'s bits about to be cleared
            (``"cleared"``, ``"recent_cleared"``) into a buffer it may reuse for the next
            checkpoint's (fresh ones are page-faulted in on the training thread); a clone
            if ``None``.
        cleared: where the copies go, each before its bits are cleared: if this is cut
            short (an exception, an interrupt), it holds at least what was cleared.

    Returns:
        A copy of what was cleared (``cleared``, if given), for :func:`put_back_bits`.
    """
    copy = keep if keep is not None else lambda _i, _name, bits: bits.clone()
    cleared = ClearedBits() if cleared is None else cleared
    for i, shard in enumerate(shards):
        if shard.recent is not None:
            cleared.recent.append(copy(i, "recent_cleared", shard.recent))
            shard.recent.zero_()
    if not decision.clear_bits:
        return cleared
    for i, shard in enumerate(shards):
        if shard.words is not None:
            cleared.words.append(copy(i, "cleared", shard.words))
    for i, shard in enumerate(shards):
        if shard.words is None:
            continue
        rows = None if prioritized is None else prioritized[i]
        if rows is None:
            shard.words.zero_()
        else:
            bitmap.clear_bits(shard.words, rows)
        if shard.priority is not None:
            # MFU counts and SSU samples restart with the bits.
            shard.priority.clear(rows)
    return cleared


def put_back_bits(shards: list[LocalShard], cleared: ClearedBits) -> None:
    """ORs back the bits :func:`restart_bits` cleared for a checkpoint that failed."""
    for shard in shards:
        shard.drain()
    words = [s.words for s in shards if s.words is not None]
    recent = [s.recent for s in shards if s.recent is not None]
    for live, saved in [*zip(words, cleared.words), *zip(recent, cleared.recent)]:
        live |= saved


def resume_chain(
    shards: list[LocalShard],
    policy: Policy,
    saved_policy: str,
    chain: ChainState,
    from_deltas: list[torch.Tensor],
    requantized: bool = False,
) -> ChainState:
    """The chain state, and the bits, after a full restore of a committed checkpoint.

    A checkpoint written with the same policy continues its chain. The bits restart,
    except that a cumulative policy's next delta must hold every row changed since the
    baseline, including those the restore took from the chain's deltas
    (``from_deltas``: a ``(rows,)`` bool mask per shard). Another policy's checkpoint
    starts a new baseline.

    ``requantized``: the deltas' rows were quantized, so the next delta stores the
    restored rows quantized again, which is not always the bytes the restored checkpoint
    stored: they count as changed since it, for a follower to read them.
    """
    for shard in shards:
        shard.drain()
        if shard.words is not None:
            shard.words.zero_()
        if shard.recent is not None:
            shard.recent.zero_()  # the next checkpoint's changes are since this one
    if saved_policy != policy.name:
        return ChainState()
    if policy.cumulative:
        for shard, mask in zip(shards, from_deltas):
            if shard.words is not None:
                shard.words |= bitmap.from_mask(mask)
            if requantized and shard.words is not None and shard.recent is not None:
                shard.recent |= bitmap.from_mask(mask)
    return chain
