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

A shard is merged a window of its rows at a time, merged as stored or decoded: each link's
ids are read first (:mod:`torchrec_cnr.read.plan`), then each window's rows of every link
(the checked blocks they lie in, each read once), in parallel, and the window is written
before the next is read, so memory is about ``IOOptions.read_memory_mb`` where set, else
:data:`WINDOW_OBJECTS` data objects, whatever the shard's size: what the process's other
reads leave of it (:class:`~torchrec_cnr.read.MemoryBudget`).

Crash safety is that of a save: the new directory counts only once the manifest names
it; killed mid-compaction, the old chain stays the restore target.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from torchrec_cnr.commit import CommitTarget, append
from torchrec_cnr.encoding import FP32, ShardContent, ShardRecord, build_record, write_part
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Entry, Manifest
from torchrec_cnr.read.chain import ChainReader, missing_step
from torchrec_cnr.read.geometry import overlaps, place, scatter, scatter_weight, states_fit
from torchrec_cnr.read.items import MemoryBudget, ReadItem, ReadPlan
from torchrec_cnr.read.plan import carry_out
from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.snapshot import (
    IndexPart,
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


WINDOW_OBJECTS = 4
"""A compaction merges a shard's rows a window at a time: the merged rows of a window and
every link's rows in it take about this many data objects (``IOOptions.object_mb``), where
``IOOptions.read_memory_mb`` is not set."""

Write = Callable[[dict[str, torch.Tensor], int, "int | None"], None]
"""``write(tensors, first row, rows)``: stored tensors of a compacted shard by name, each
its rows from ``first row`` on of ``rows`` (``None``: each tensor whole)."""


class _Spans:
    """Spans of rows of a chain's stored tensors, each tensor's spans ascending, each
    checked block read once: a tensor keeps its rows from its last span on (read in whole
    blocks, at most a block past that span once the next is asked for), the next span's
    first rows come from there and only the blocks past them are read. A tensor not stored
    in blocks (an older format) is read whole once."""

    def __init__(self, chain: ChainReader) -> None:
        self.chain = chain
        self._held: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}

    def read(
        self, spans: list[tuple[int, ShardRecord, str, tuple[int, int]]]
    ) -> list[torch.Tensor]:
        """Rows ``lo..hi - 1`` of each stored tensor ``(link, record, name, (lo, hi))``,
        the reads all in parallel."""
        held, todo, items = self._held, [], []
        for n, rec, name, (lo, hi) in spans:
            r0, have = held.pop((n, name), (0, None))
            start = lo
            if have is not None and r0 <= lo <= r0 + have.shape[0]:
                if hi > r0 + have.shape[0]:  # only its rows from lo on stay (a block at most)
                    have, r0 = have[lo - r0 :].clone(), lo
                held[(n, name)] = r0, have
                start = r0 + have.shape[0]
            blocks = None
            if start < hi:
                sums = rec.block_checksums.get(name)
                blocks = self.chain.reader(n).block_rows(rec.spec.rank, name, start, hi, sums)
                if blocks is None:
                    held[(n, name)] = (0, self.chain.tensor(n, rec.spec.rank, name))
                else:
                    items.append(ReadItem.of(n, rec, name, blocks))
            todo.append(((n, name), lo, hi, blocks))
        got = iter(self.chain.windows(items))
        out = []
        for key, lo, hi, blocks in todo:
            if blocks is not None:
                r0, have = held.get(key, (0, None))
                new = next(got)
                held[key] = blocks[0], new
                if lo < blocks[0]:  # its first rows from the blocks read before
                    assert have is not None
                    out.append(torch.cat([have[lo - r0 :], new[: hi - blocks[0]]]))
                    continue
            r0, have = held[key]
            out.append(have[lo - r0 : hi - r0])
        return out


def _merge_stored(
    chain: ChainReader,
    target: ShardRecord,
    sources: list[tuple[int, ShardRecord]],
    window_bytes: int,
    write: Callable[[dict[str, torch.Tensor], int], None],
) -> None:
    """Rows merged as stored, a window of rows at a time: the baseline's rows of the
    window, overwritten row by row by each delta's; each window handed to
    ``write(tensors, first row)`` by the baseline's stored names. A window's merged rows
    and the links' rows in it take about ``window_bytes``, read as :class:`_Spans`."""
    (n0, base), deltas = sources[0], sources[1:]
    offset, rows = target.spec.row_offset, target.spec.rows
    row_bytes = sum(chain.reader(n0).row_bytes(base.spec.rank, name) for name in base.row_names)
    step = MemoryBudget(window_bytes).rows(row_bytes * len(sources))
    reader = _Spans(chain)
    stored = [
        (n, rec, [(ids - offset, at) for ids, at in chain.stored(n, rec)]) for n, rec in deltas
    ]
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        spans = [(n0, base, name, (lo, hi)) for name in base.row_names]
        merged = dict(zip(base.row_names, reader.read(spans)))
        for n, rec, pieces in stored:
            pairs = _same_tensors(base, rec)
            for local, at in pieces:
                a, b = torch.searchsorted(local, torch.tensor([lo, hi])).tolist()
                if a < b:
                    span = (int(at[a]), int(at[b - 1]) + 1)
                    got = reader.read([(n, rec, theirs, span) for _, theirs in pairs])
                    for (name, _), theirs_rows in zip(pairs, got):
                        put_rows(merged[name], local[a:b] - lo, theirs_rows)
        write(merged, lo)
        del merged  # its rows are written: not held while the next window is read


def _same_tensors(base: ShardRecord, rec: ShardRecord) -> list[tuple[str, str]]:
    """``(base's name, rec's name)`` of each stored tensor of two records of one format."""
    pairs = list(zip(base.value_names, rec.value_names))
    return pairs + [(info.tensor, rec.states[name].tensor) for name, info in base.states.items()]


def _decoded_states(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]]
) -> dict[str, torch.Tensor]:
    """The optimizer states a decoded merge gives ``target``, as ``meta`` tensors of its
    shape: those of every source whose state carries over (as in a restore)."""
    ts, states = target.spec, {}
    for n, rec in sources:
        if states_fit(rec, target.optimizer, target.states):
            for name, info in rec.states.items():
                saved = chain.reader(n).rows_like(rec.spec.rank, info.tensor)
                shape = (ts.rows, ts.cols) if saved.dim() == 2 else (ts.rows,)
                states[name] = torch.empty(shape, device="meta")
    return states


def _merge_decoded(
    chain: ChainReader,
    target: ShardRecord,
    sources: list[tuple[int, ShardRecord]],
    states: dict[str, torch.Tensor],
    window_bytes: int,
    write: Callable[[dict[str, torch.Tensor], int], None],
) -> None:
    """Rows decoded to the values a restore gives, placed as a restore places them (later
    links winning), a window of the target's rows at a time: of each source, the stored
    rows that land in the window (a span of each run of its rows stored in ascending order,
    read as :class:`_Spans`). Each window is handed to ``write(tensors, first row)``: the
    values as ``""``, each state of ``states`` by its name."""
    ts = target.spec
    row_bytes = 4 * ts.cols + sum(4 * t[0].numel() for t in states.values())
    step = MemoryBudget(window_bytes).rows(2 * row_bytes)  # the window, and what lands in it
    reader = _Spans(chain)
    runs = [
        (n, rec, states_fit(rec, target.optimizer, target.states), chain.stored(n, rec))
        for n, rec in sources
    ]
    for lo in range(0, ts.rows, step):
        window = replace(ts, row_offset=ts.row_offset + lo, rows=min(step, ts.rows - lo))
        values = torch.zeros(window.rows, ts.cols)
        merged = {name: torch.zeros((window.rows, *t.shape[1:])) for name, t in states.items()}
        bounds = torch.tensor([window.row_offset, window.row_offset + window.rows])
        for n, rec, fits, stored in runs:
            names = [*rec.value_names, *(i.tensor for i in rec.states.values() if fits)]
            for ids, at in stored:
                a, b = torch.searchsorted(ids, bounds).tolist()
                where = place(rec.spec, ids[a:b], window) if a < b else None
                if where is None:
                    continue
                span = (int(at[a]), int(at[b - 1]) + 1)
                got = dict(zip(names, reader.read([(n, rec, name, span) for name in names])))
                scatter_weight(values, where, rec, got.__getitem__, chain.io.encode)
                for name, info in rec.states.items() if fits else ():
                    scatter(merged[name], where, got[info.tensor].float())
        write({"": values, **merged}, lo)
        del values, merged  # written: not held while the next window is read


def _plan(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]]
) -> ReadPlan:
    """What :func:`_compact_record` reads before it merges: each source's ids and the last
    link's ``recent`` ids (the rows themselves are read a window at a time)."""
    items = [
        ReadItem(n, rec.spec.rank, rec.ids_name(rec.key)) for n, rec in sources if not rec.all_rows
    ]
    if target.recent in ("ids", "tail"):
        items.append(ReadItem(len(chain.links) - 1, target.spec.rank, target.recent_name))
    return ReadPlan(tuple((item,) for item in items))


def _compact_record(
    chain: ChainReader, target: ShardRecord, key: str, window_bytes: int, write: Write
) -> ShardRecord:
    """The compacted record of one shard of the chain's last checkpoint; its tensors go
    to ``write`` (by their stored names), a window of rows at a time.

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
    chain = carry_out(chain, _plan(chain, target, sources), MemoryBudget(None)).chain
    recent: torch.Tensor | None | Literal["unknown"] = "unknown"
    if target.recent in ("ids", "tail"):
        recent = chain.tensor(len(chain.links) - 1, target.spec.rank, target.recent_name)
    elif target.recent == "stored":
        # Every row the last link stored changed; the compacted record stores them all.
        recent = None if target.all_rows else chain.saved_ids(len(chain.links) - 1, target)
        if recent is not None and recent.numel() == target.spec.rows:
            recent = None
    # The record is built from tensors of the merged shape on the meta device (nothing
    # held); the merge writes their rows window by window, by the names it gives them.
    if as_stored:
        reader = chain.reader(sources[0][0])
        shaped = {name: reader.rows_like(first.spec.rank, name) for name in first.row_names}
        values = {
            ("" if first.format == FP32 else part): shaped[name]
            for part, name in zip(first.parts or [""], first.value_names)
        }
        states = {name: shaped[info.tensor] for name, info in first.states.items()}
        fmt = first.format
    else:
        states = _decoded_states(chain, target, sources)
        values = {"": torch.empty(target.spec.rows, target.spec.cols, device="meta")}
        shaped, fmt = {"": values[""], **states}, FP32
    content = ShardContent(values, fmt, target.optimizer, states, target.scalars, recent=recent)
    record, tensors = build_record(target.spec, key, content)
    stored = {id(t): name for name, t in tensors.items()}
    renamed = {name: stored[id(t)] for name, t in shaped.items()}
    rows = target.spec.rows

    def put(got: dict[str, torch.Tensor], row0: int) -> None:
        write({renamed[n]: t for n, t in got.items()}, row0, rows)

    if as_stored:
        _merge_stored(chain, target, sources, window_bytes, put)
    else:
        _merge_decoded(chain, target, sources, states, window_bytes, put)
    write({n: t for n, t in tensors.items() if n not in renamed.values()}, 0, None)
    return record


def _writes(writer: SnapshotWriter, rank: int) -> Write:
    """The ``write`` of storage rank ``rank``'s compacted shards into ``writer``: each
    call's tensors, then a wait (one window of one shard's merged rows in memory at a time)."""

    def write(tensors: dict[str, torch.Tensor], row0: int, rows: int | None) -> None:
        for name, t in tensors.items():
            writer.write(rows_path(rank, name), t, row0, rows)
        writer.wait()

    return write


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
    memory = MemoryBudget(io.options.read_budget(None, WINDOW_OBJECTS * io.options.object_mb))
    window_bytes = memory.share()  # what the process's other reads leave of the bound
    assert window_bytes is not None
    for i, target in enumerate(chain.manifest.shards(entry)):
        if target.spec.rank % world != rank:
            continue
        if stop is not None and stop.is_set():
            raise Stopped(f"the compaction into {new_id} was stopped")
        write = _writes(writer, target.spec.rank)
        out.records.append(_compact_record(chain, target, f"c{i}", window_bytes, write))
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
