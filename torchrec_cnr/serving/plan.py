"""Which rows a follower must read to go from the checkpoint it serves to another one.

Every checkpoint of format 4 records, per stored shard, the rows that changed since the
checkpoint before it (``Summary.since``): every stored row (a consecutive delta), or the
ids its ``<key>.recent`` tensor lists (a cumulative delta, a baseline). Following the
``since`` links back from the target to the served checkpoint and uniting those sets
gives every row whose value differs, read once each however far behind the follower is.

- A compacted checkpoint stands for the one it compacted (``compacted_from``).
- A job that restored an older checkpoint and went on (a rewind) links back to that
  checkpoint: the rows that differ are those changed on either side since the two paths
  meet.
- Where the links break (the served checkpoint or one on the way was retired by
  ``keep_last``, a format 3 root, a new job that did not restore), the plan is *cold*:
  every row of the target's chain, each read once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from torchrec_cnr.encoding import ShardRecord
from torchrec_cnr.manifest import Entry, Manifest, Summary
from torchrec_cnr.read.chain import ChainReader

__all__ = ["UpdatePlan", "changed_rows", "changed_since", "plan_update"]


@dataclass
class UpdatePlan:
    """What one update reads and applies."""

    target: Entry
    """The committed checkpoint to serve."""
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """Table (qualified name) -> ``(k,)`` ascending global ids of the rows to read; a table
    absent from it reads every row (a cold plan) or nothing (a warm plan)."""
    cold: bool = False
    """Every row of every table is read: no path of recorded changes from the served one."""
    rewind: bool = False
    """The target is older than the served checkpoint (the job restored and went on)."""
    dense: bool = True
    """The dense state differs from the served one."""
    path: list[str] = field(default_factory=list)
    """The checkpoints whose recorded changes the plan unites."""
    newer: list[Summary] = field(default_factory=list)
    """Where the target is ahead of the served checkpoint (no rewind): the checkpoints
    from the target back to the first after the served one, newest first. Each stores the
    rows it changed with their values at the target's step, unless a newer one changed
    them again: a follower behind reads them there (a tail, or a consecutive delta, is
    one run) rather than scattered through the target's chain."""


def _same_state(entry: Summary, ckpt_id: str) -> bool:
    return entry.id == ckpt_id or entry.compacted_from == ckpt_id


def _lineage(manifest: Manifest, start: Summary) -> Iterator[tuple[set[str], Summary | None]]:
    """``start`` and the checkpoints it links back to through ``since``, newest first, each
    as the ids that name its state (its own, and the one it compacted) and its entry; the
    last may be a link the root no longer holds (entry ``None``): nothing is known beyond
    it. Read as far as its caller goes: each link is the manifest's or its own record."""
    entry: Summary | None = start
    seen: set[str] = set()
    while entry is not None and entry.id not in seen:
        seen.add(entry.id)
        yield {entry.id} | ({entry.compacted_from} if entry.compacted_from else set()), entry
        if entry.since is None:
            return
        previous = manifest.link(entry.since)
        if previous is None:
            yield {entry.since}, None
        entry = previous


def _meet(
    ahead: Iterator[tuple[set[str], Summary | None]],
    behind: Iterator[tuple[set[str], Summary | None]],
) -> tuple[list[Summary | None], list[Summary | None], tuple[int, int] | None]:
    """Walks both lineages a link at a time until one reaches a state the other has: their
    newest common checkpoint (each side meets the other's ancestors in order, so the first
    shared state found is it). Returns each side's links walked and where they meet."""
    sides: list[list[tuple[set[str], Summary | None]]] = [[], []]
    going: list[Iterator[tuple[set[str], Summary | None]] | None] = [ahead, behind]
    while going[0] is not None or going[1] is not None:
        for side in (0, 1):
            walk = going[side]
            if walk is None:
                continue
            step = next(walk, None)
            if step is None:
                going[side] = None
                continue
            sides[side].append(step)
            other = sides[1 - side]
            at = next((i for i, (names, _) in enumerate(other) if names & step[0]), None)
            if at is not None:
                mine = len(sides[side]) - 1
                meet = (mine, at) if side == 0 else (at, mine)
                return [e for _, e in sides[0]], [e for _, e in sides[1]], meet
    return [e for _, e in sides[0]], [e for _, e in sides[1]], None


def changed_rows(
    chain: ChainReader, entry: Summary, rec: ShardRecord
) -> tuple[torch.Tensor, int | None]:
    """The ascending ids of the rows ``rec`` (of ``entry``, its ``recent`` recorded)
    changed since the checkpoint before it, and the position of the first where they are
    stored in one run (a tail, or every row of a delta that stores only them), else
    ``None``. The small ``ids`` and ``recent`` tensors it reads stay in ``chain``
    (:meth:`ChainReader.kept`): the rows are found by them next."""
    ss = rec.spec
    if rec.recent == "tail":
        ids = chain.kept(entry, ss.rank, rec.recent_name)
        return ids.to(torch.int64), rec.saved_rows - rec.recent_rows
    if rec.recent == "ids":
        return chain.kept(entry, ss.rank, rec.recent_name).to(torch.int64), None
    assert rec.recent == "stored", "an unrecorded change has no rows"
    if rec.all_rows:
        return torch.arange(ss.row_offset, ss.row_offset + ss.rows), 0
    return chain.kept(entry, ss.rank, rec.ids_name(rec.key)).to(torch.int64), 0


def changed_since(chain: ChainReader, entry: Summary) -> dict[str, torch.Tensor] | None:
    """Table -> ascending global ids of the rows ``entry`` records as changed since
    ``entry.since``; ``None`` if some shard did not record them.

    Args:
        chain: any open chain of the same root (see :func:`changed_rows`).
    """
    parts: dict[str, list[torch.Tensor]] = {}
    for rec in chain.manifest.shards(entry):
        if rec.recent == "unknown":
            return None
        if rec.saved_rows:
            parts.setdefault(rec.spec.table, []).append(changed_rows(chain, entry, rec)[0])
    return {t: _union(p) for t, p in parts.items()}


def _union(parts: list[torch.Tensor]) -> torch.Tensor:
    """The distinct ids in any of ``parts``, ascending: a lone part that is already so,
    as it is."""
    lone = parts[0]
    if len(parts) == 1 and bool((lone[1:] > lone[:-1]).all()):
        return lone
    return torch.unique(torch.cat(parts))


def plan_update(
    manifest: Manifest, chain: ChainReader, served: Entry | None, served_id: str | None
) -> UpdatePlan | None:
    """How to go from the served checkpoint to ``chain``'s (the target); ``None`` if the
    follower serves it already.

    Args:
        manifest: the committed manifest that names the target.
        chain: the target's chain, open.
        served: the served checkpoint's entry as the follower last read it, if any.
        served_id: its id (``None``: nothing served yet, a cold start).
    """
    target = chain.entry
    if served_id is not None and _same_state(target, served_id):
        return None
    plan = UpdatePlan(target)
    if served is not None:
        plan.dense = served.dense_checksums != target.dense_checksums
        plan.rewind = target.step < served.step
    behind = _lineage(manifest, served) if served is not None else iter([({served_id or ""}, None)])
    ahead, walked, meet = _meet(_lineage(manifest, target), behind)
    if served_id is None or meet is None:
        plan.cold = True
        return plan
    a, b = meet
    path = ahead[:a] + walked[:b]
    if any(e is None for e in path):
        plan.cold = True
        return plan
    plan.path = [e.id for e in path if e is not None]
    if b == 0:
        plan.newer = [e for e in path if e is not None]
    rows: dict[str, list[torch.Tensor]] = {}
    for entry in path:
        assert entry is not None
        changed = changed_since(chain, entry)
        if changed is None:
            plan.cold = True
            return plan
        for table, ids in changed.items():
            rows.setdefault(table, []).append(ids)
    plan.rows = {t: _union(p) for t, p in rows.items()}
    return plan
