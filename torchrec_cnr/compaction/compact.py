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

Each compacted shard's stored tensors, of every link, are read first, in parallel, as
one plan (:mod:`torchrec_cnr.read.plan`): memory is that shard's tensors of the chain.

Crash safety is that of a save: the new directory counts only once the manifest names
it; killed mid-compaction, the old chain stays the restore target.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from torchrec_cnr.commit import CommitTarget, append
from torchrec_cnr.encoding import FP32, ShardContent, ShardRecord, build_record, write_part
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Entry, Manifest
from torchrec_cnr.read.chain import ChainReader, missing_step
from torchrec_cnr.read.geometry import overlaps, place, scatter, scatter_weight, slot, states_fit
from torchrec_cnr.read.items import MemoryBudget, ReadItem, ReadPlan
from torchrec_cnr.read.plan import carry_out
from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.schema import IndexPart
from torchrec_cnr.snapshot import (
    SnapshotWriter,
    app_path,
    checkpoint_id,
    dense_path,
    rows_path,
    write_index,
)

__all__ = ["CompactedPart", "Stopped", "compact_entry", "compact_part", "compacted_entry"]


def _layout(rec: ShardRecord) -> tuple[object, ...]:
    """What two records must share for their stored rows to merge as they are: the region,
    the format, the quantized parts and the states (by name, layout and dtype; not by stored
    name, which carries the record's key: a compaction's keys are not a save's)."""
    s = rec.spec
    states = {name: (info.layout, info.dtype) for name, info in rec.states.items()}
    return (s.row_offset, s.col_offset, s.rows, s.cols, rec.format, rec.parts, states)


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
            scatter(slot(states, name, shape), where, saved)
    return values, states


def _plan(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]], stored: bool
) -> ReadPlan:
    """Every stored tensor :func:`_compact_record` reads: each source's ids, values and the
    states that carry over (all of them where rows merge ``stored``), and the last link's
    ``recent`` ids."""
    items = []
    for n, rec in sources:
        names = [] if rec.all_rows else [rec.ids_name(rec.key)]
        names += rec.value_names
        if stored or states_fit(rec, target.optimizer, target.states):
            names += [info.tensor for info in rec.states.values()]
        items += [ReadItem(n, rec.spec.rank, name) for name in names]
    if target.recent in ("ids", "tail"):
        items.append(ReadItem(len(chain.links) - 1, target.spec.rank, target.recent_name))
    return ReadPlan(tuple((item,) for item in items))


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
        and _layout(first)[:4] == _layout(target)[:4]
        and all(_layout(r) == _layout(first) for _, r in sources)
    )
    chain = carry_out(chain, _plan(chain, target, sources, as_stored), MemoryBudget(None)).chain
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
class CompactedPart:
    """What one writer contributed to a compacted checkpoint."""

    records: list[ShardRecord] = field(default_factory=list)
    index: IndexPart = field(default_factory=IndexPart)
    parts: dict[int, str] = field(default_factory=dict)
    """Storage rank -> the checksum of the part of its records this writer wrote."""


class Stopped(Exception):
    """A compaction stopped before its end (see :func:`compact_part`'s ``stop``)."""


def compact_part(
    chain: ChainReader,
    new_id: str,
    rank: int,
    world: int,
    io: IOContext,
    stop: threading.Event | None = None,
) -> CompactedPart:
    """Compacts the shards of the storage ranks ``rank``, ``rank + world``, ... of the chain.

    Raises:
        Stopped: ``stop`` was set; it is looked at between shards.
    """
    entry = chain.entry
    writer = SnapshotWriter(chain.storage, new_id, f"r{rank}", io.io, io.object_bytes)
    out = CompactedPart()
    for i, target in enumerate(chain.manifest.shards(entry)):
        if target.spec.rank % world != rank:
            continue
        if stop is not None and stop.is_set():
            raise Stopped(f"the compaction into {new_id} was stopped")
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


def compacted_entry(chain: ChainReader, new_id: str, parts: list[CompactedPart]) -> Entry:
    """Writes the index of the compacted checkpoint ``new_id`` (call once every writer's
    part is durable) and returns its entry, ready to commit."""
    entry = chain.entry
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
    part = compact_part(chain, new_id, 0, 1, io)
    # IMPORTANT: the part is durable: the index goes last, then the manifest.
    compacted = compacted_entry(chain, new_id, [part])
    append(target, compacted)
    return compacted
