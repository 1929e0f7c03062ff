"""Compaction: merging a chain into one full checkpoint, committed like any other.

A consecutive chain never takes a new baseline: its storage grows without bound and a
restore reads every link. Compaction writes the state a chain restores to as one full
checkpoint of the same step; from then on a restore reads that one, and ``keep_last``
can retire the older links.

Nothing is quantized twice. Where every saved shard of a chain has the same layout and
format, rows are merged as they are stored (packed codes, scales, bias), later links
winning; where they differ (a resharded or re-formatted chain), the rows are decoded to
the exact fp32 values a restore gives and stored as fp32. A compacted fp32 chain is
bit-exact, a quantized one restores to the same values as the chain.

Crash safety is that of a save: the new directory counts only once the manifest names
it; killed mid-compaction, the old chain stays the restore target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import (
    CommitTarget,
    Entry,
    Manifest,
    Pending,
    append,
    remove_failed,
    write_and_commit,
)
from torchrec_cnr.commit.background import JobResult
from torchrec_cnr.encoding import FP32, ShardContent, ShardRecord, build_record, write_part
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.read.chain import ChainReader, missing_step
from torchrec_cnr.read.geometry import overlaps, place, scatter, scatter_weight, states_fit
from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.schema import IndexPart
from torchrec_cnr.selection.policy import ChainState
from torchrec_cnr.snapshot import (
    SnapshotWriter,
    app_path,
    checkpoint_id,
    dense_path,
    rows_path,
    write_index,
)

__all__ = ["commit_and_compact", "compact", "compact_entry", "compaction_job"]


def _region(rec: ShardRecord) -> tuple[int, int, int, int]:
    s = rec.spec
    return (s.row_offset, s.col_offset, s.rows, s.cols)


def _merge_stored(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]]
) -> dict[str, torch.Tensor]:
    """Rows merged as stored: the baseline's tensors, overwritten row by row by each
    delta; keyed by the baseline's stored names."""
    (n0, base), deltas = sources[0], sources[1:]
    merged = {name: chain.tensor(n0, base.spec.rank, name).clone() for name in base.row_names}
    for n, rec in deltas:
        local = chain.saved_ids(n, rec) - target.spec.row_offset
        for name, theirs in _same_tensors(base, rec):
            put_rows(merged[name], local, chain.tensor(n, rec.spec.rank, theirs))
    return merged


def _same_tensors(base: ShardRecord, rec: ShardRecord) -> list[tuple[str, str]]:
    """``(base's name, rec's name)`` of each stored tensor of two records of one format."""
    pairs = list(zip(base.value_names, rec.value_names))
    return pairs + [(info.tensor, rec.states[name].tensor) for name, info in base.states.items()]


def _merge_decoded(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows decoded to the values a restore gives, placed as a restore places them."""
    ts = target.spec
    values = torch.zeros(ts.rows, ts.cols)
    states: dict[str, torch.Tensor] = {}
    for n, rec in sources:
        where = place(rec.spec, chain.saved_ids(n, rec), ts)
        if where is None:
            continue
        scatter_weight(values, where, rec, chain.fetch(n, rec), chain.io.encode)
        if not states_fit(rec, target.optimizer, target.states):
            continue  # another optimizer's state does not carry over (as in a restore)
        for name, info in rec.states.items():
            saved = chain.tensor(n, rec.spec.rank, info.tensor).float()
            shape = (ts.rows, ts.cols) if saved.dim() == 2 else (ts.rows,)
            scatter(states.setdefault(name, torch.zeros(shape)), where, saved)
    return values, states


def _compact_record(
    chain: ChainReader, target: ShardRecord, key: str
) -> tuple[ShardRecord, dict[str, torch.Tensor]]:
    """The compacted record of one shard of the chain's last checkpoint, and its tensors.

    It stands for that checkpoint, so it keeps which rows changed since the one before.
    """
    sources = [
        (n, rec) for n, rec in chain.records(target.spec.table) if overlaps(rec.spec, target.spec)
    ]
    first = sources[0][1] if sources else target
    as_stored = (
        bool(sources)
        and first.all_rows
        and all(
            _region(r) == _region(target)
            and r.format == first.format
            and r.parts == first.parts
            and r.states == first.states
            for _, r in sources
        )
    )
    if as_stored:
        merged = _merge_stored(chain, target, sources)
        values = {
            ("" if first.format == FP32 else part): merged[name]
            for part, name in zip(first.parts or [""], first.value_names)
        }
        states = {name: merged[info.tensor] for name, info in first.states.items()}
        fmt = first.format
    else:
        decoded, states = _merge_decoded(chain, target, sources)
        values, fmt = {"": decoded}, FP32
    recent: torch.Tensor | None | Literal["unknown"] = "unknown"
    if target.recent in ("ids", "tail"):
        recent = chain.tensor(len(chain.links) - 1, target.spec.rank, target.recent_name)
    elif target.recent == "stored":
        # Every row the last link stored changed; the compacted record stores them all.
        recent = None if target.all_rows else chain.saved_ids(len(chain.links) - 1, target)
        if recent is not None and recent.numel() == target.spec.rows:
            recent = None
    content = ShardContent(values, fmt, target.optimizer, states, target.scalars, recent=recent)
    return build_record(target.spec, key, content)


@dataclass
class _Part:
    """What one writer contributed to a compacted checkpoint."""

    records: list[ShardRecord] = field(default_factory=list)
    index: IndexPart = field(default_factory=IndexPart)
    parts: dict[int, str] = field(default_factory=dict)
    """Storage rank -> the checksum of the part of its records this writer wrote."""


def _write_part(chain: ChainReader, new_id: str, rank: int, world: int, io: IOContext) -> _Part:
    """Compacts the shards of the storage ranks ``rank``, ``rank + world``, ... of the chain."""
    entry = chain.entry
    writer = SnapshotWriter(chain.storage, new_id, f"r{rank}", io.io, io.object_bytes)
    out = _Part()
    for i, target in enumerate(entry.shards):
        if target.spec.rank % world != rank:
            continue
        record, tensors = _compact_record(chain, target, key=f"c{i}")
        for name, t in tensors.items():
            writer.write(rows_path(target.spec.rank, name), t)
        writer.wait()  # one shard's merged rows in memory at a time
        out.records.append(record)
    if rank == 0:
        for name, t in chain.dense().items():
            writer.write(dense_path(name), t, replicated=True)
        for r in range(entry.world_size):
            writer.add_bytes(app_path(r), chain.app_state(r))
    part = writer.finish()
    by_rank: dict[int, list[ShardRecord]] = {}
    for record in out.records:
        record.take_checksums(part.checksums, part.blocks)
        by_rank.setdefault(record.spec.rank, []).append(record)
    for storage_rank, records in by_rank.items():  # each storage rank's records: one part
        out.parts[storage_rank] = write_part(chain.storage, new_id, storage_rank, records)
    chain.storage.make_durable(new_id)
    out.index = part.index
    return out


def _commit(chain: ChainReader, new_id: str, parts: list[_Part], target: CommitTarget) -> Entry:
    entry = chain.entry
    # IMPORTANT: every writer's part is durable: the index goes last, then the manifest.
    write_index(chain.storage, new_id, [p.index for p in parts], entry.world_size)
    records = sorted((r for p in parts for r in p.records), key=lambda r: int(r.key[1:]))
    compacted = Entry(
        id=new_id,
        seq=entry.seq,
        step=entry.step,
        kind="full",
        policy=entry.policy,
        chain=[new_id],
        sizes=[],
        world_size=entry.world_size,
        tables=dict(entry.tables),
        dense=dict(entry.dense),
        shards=records,
        dense_checksums=dict(entry.dense_checksums),
        app_checksums=list(entry.app_checksums),
        bytes=chain.storage.tree_bytes(new_id),
        saved_at=entry.saved_at,
        restores_before=entry.restores_before,
        interval_decision=entry.interval_decision,
        compacted_from=entry.id,
        since=entry.since,
        shard_parts={str(r): c for p in parts for r, c in sorted(p.parts.items())},
    )
    append(target, compacted)
    return compacted


def compact_entry(target: CommitTarget, io: IOContext, step: int | None = None) -> Entry | None:
    """Compacts the chain of a committed checkpoint in this one process (``cnr compact``).

    Returns:
        The compacted checkpoint's entry; ``None`` if that checkpoint already is a lone full one.
    """
    manifest = Manifest.load(target.storage)
    entry = manifest.find(step)
    if entry is None:
        raise missing_step(manifest, step, target.storage.url)
    if entry.depth == 1:
        return None
    chain = ChainReader(target.storage, manifest, entry, io)
    new_id = checkpoint_id(entry.seq, entry.step, target.generation, compacted=True)
    part = _write_part(chain, new_id, 0, 1, io)
    return _commit(chain, new_id, [part], target)


def compact(
    group: Collective, target: CommitTarget, io: IOContext, every: int | None = None
) -> ChainState | None:
    """Compacts the chain of the latest committed checkpoint, collectively over ``group``.

    Each rank merges the shards that its storage rank saved; rank 0 also copies the
    dense state and every rank's ``app_state``, writes the index and commits.

    Args:
        every: compact only if that chain holds at least this many deltas.

    Returns:
        The chain state after it (the compacted checkpoint alone), or ``None`` if there
        was nothing to compact.

    Raises:
        CheckpointError: another job took the root over; nothing was committed.
        CheckpointReadError: the chain is damaged; nothing was committed.
    """
    manifest: Manifest = group.on_rank0(lambda: Manifest.load(target.storage))
    manifest.attach(target.storage)
    latest = manifest.latest()
    if latest is None or latest.depth - 1 < max(every or 1, 1):
        return None
    new_id = checkpoint_id(latest.seq, latest.step, target.generation, compacted=True)
    error: Exception | None = None
    part = None
    chain = None
    try:
        chain = ChainReader(target.storage, manifest, latest, io)
        part = _write_part(chain, new_id, group.rank, group.world_size, io)
    except Exception as e:  # every rank learns of it before anyone commits
        error = e
    try:
        group.agree(error)
    except Exception:
        if group.rank == 0:  # no rank writes into it any more: give its space back
            remove_failed(target, new_id)
        raise
    assert chain is not None
    parts = group.gather_on_rank0(part)
    group.on_rank0(
        lambda: _commit(chain, new_id, [p for p in parts or [] if p is not None], target)
    )
    return ChainState([new_id], [])


def commit_and_compact(
    pending: Pending,
    target: CommitTarget,
    io: IOContext,
    every: int | None,
    what: str,
    group: Collective,
) -> JobResult:
    """A background job: writes and commits ``pending``, then compacts the chain if it has
    grown ``every`` deltas long (``CheckpointConfig.compact_every``; never if ``None``).
    A failed compaction leaves the committed checkpoint as it is, and is reported."""
    written = write_and_commit(pending, group, target)
    if every is None:
        return JobResult(written, what)
    try:
        return JobResult(compact(group, target, io, every) or written, what)
    except Exception as e:  # the checkpoint itself is committed
        return JobResult(written, what, followup_error=e)


def compaction_job(
    target: CommitTarget, io: IOContext, chain: ChainState, what: str, group: Collective
) -> JobResult:
    """A background job: compacts the latest chain (see :func:`compact`); ``chain`` is the
    chain state it leaves if there is nothing to compact."""
    return JobResult(compact(group, target, io) or chain, what)
