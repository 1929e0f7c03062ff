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
from functools import partial
from typing import Any

import torch

from torchrec_cnr import knobs
from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import Entry, Manifest, Target, append
from torchrec_cnr.encoding import FP32, ShardRecord, StateInfo, decode_weight
from torchrec_cnr.encoding.codec import dtype_name
from torchrec_cnr.offline.tables import ChainReader
from torchrec_cnr.selection.policy import ChainState
from torchrec_cnr.storage import checkpoint_id
from torchrec_cnr.storage.layout import app_path, dense_path, rows_path
from torchrec_cnr.storage.snapshot import SnapshotWriter, write_index

__all__ = ["compact", "compact_entry"]


def _region(rec: ShardRecord) -> tuple[int, int, int, int]:
    s = rec.spec
    return (s.row_offset, s.col_offset, s.rows, s.cols)


def _overlaps(a: ShardRecord, b: ShardRecord) -> bool:
    sa, sb = a.spec, b.spec
    return (
        sa.table == sb.table
        and max(sa.row_offset, sb.row_offset)
        < min(sa.row_offset + sa.rows, sb.row_offset + sb.rows)
        and max(sa.col_offset, sb.col_offset)
        < min(sa.col_offset + sa.cols, sb.col_offset + sb.cols)
    )


def _stored_parts(rec: ShardRecord) -> list[str]:
    """Suffixes of the stored tensors that hold a record's rows (values and states)."""
    values = [".w"] if rec.format == FP32 else [f".w.{p}" for p in rec.parts]
    return values + [info.tensor.removeprefix(rec.key) for info in rec.states.values()]


def _merge_stored(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]]
) -> dict[str, torch.Tensor]:
    """Rows merged as stored: the baseline's tensors, overwritten row by row by each delta."""
    (n0, base), deltas = sources[0], sources[1:]
    merged = {
        suffix: chain.readers[n0].rows(base.spec.rank, f"{base.key}{suffix}").clone()
        for suffix in _stored_parts(base)
    }
    for n, rec in deltas:
        local = chain.saved_ids(n, rec) - target.spec.row_offset
        for suffix, tensor in merged.items():
            tensor[local] = chain.readers[n].rows(rec.spec.rank, f"{rec.key}{suffix}")
    return merged


def _merge_decoded(
    chain: ChainReader, target: ShardRecord, sources: list[tuple[int, ShardRecord]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows decoded to the values a restore gives, placed by global row and column."""
    ts = target.spec
    values = torch.zeros(ts.rows, ts.cols)
    states: dict[str, torch.Tensor] = {}
    for n, rec in sources:
        ss = rec.spec
        reader = chain.readers[n]
        ids = chain.saved_ids(n, rec)
        inside = (ids >= ts.row_offset) & (ids < ts.row_offset + ts.rows)
        rows = ids[inside] - ts.row_offset
        decoded = decode_weight(partial(reader.rows, ss.rank), rec)[inside]
        c0, c1 = (
            max(ss.col_offset, ts.col_offset),
            min(ss.col_offset + ss.cols, ts.col_offset + ts.cols),
        )
        values[rows, c0 - ts.col_offset : c1 - ts.col_offset] = decoded[
            :, c0 - ss.col_offset : c1 - ss.col_offset
        ].float()
        if rec.optimizer != target.optimizer or set(rec.states) != set(target.states):
            continue  # another optimizer's state does not carry over (as in a restore)
        holds_first_col = ss.col_offset <= ts.col_offset < ss.col_offset + ss.cols
        for name, info in rec.states.items():
            saved = reader.rows(ss.rank, info.tensor)[inside].float()
            if saved.dim() == 2:
                dst = states.setdefault(name, torch.zeros(ts.rows, ts.cols))
                dst[rows, c0 - ts.col_offset : c1 - ts.col_offset] = saved[
                    :, c0 - ss.col_offset : c1 - ss.col_offset
                ]
            elif holds_first_col:
                states.setdefault(name, torch.zeros(ts.rows))[rows] = saved
    return values, states


def _compact_record(
    chain: ChainReader, target: ShardRecord, key: str
) -> tuple[ShardRecord, dict[str, torch.Tensor]]:
    """The compacted record of one shard of the chain's last checkpoint, and its tensors."""
    sources = [
        (n, rec)
        for n, e in enumerate(chain.chain)
        for rec in e.shards
        if rec.saved_rows > 0 and _overlaps(rec, target)
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
        tensors = {f"{key}{suffix}": t for suffix, t in merged.items()}
        fmt, parts = first.format, list(first.parts)
        names = {
            name: f"{key}{info.tensor.removeprefix(first.key)}"
            for name, info in first.states.items()
        }
    else:
        values, decoded_states = _merge_decoded(chain, target, sources)
        tensors = {f"{key}.w": values} | {f"{key}.{n}": t for n, t in decoded_states.items()}
        fmt, parts = FP32, []
        names = {name: f"{key}.{name}" for name in decoded_states}
    states = {
        name: StateInfo(
            stored, "row" if tensors[stored].dim() == 1 else "element", dtype_name(tensors[stored])
        )
        for name, stored in names.items()
    }
    record = ShardRecord(
        spec=target.spec,
        key=key,
        saved_rows=target.spec.rows,
        all_rows=True,
        optimizer=target.optimizer,
        states=states,
        scalars=dict(target.scalars),
        format=fmt,
        parts=parts,
        nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )
    return record, tensors


@dataclass
class _Part:
    """What one writer contributed to a compacted checkpoint."""

    records: list[ShardRecord] = field(default_factory=list)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)


def _write_part(chain: ChainReader, new_id: str, rank: int, world: int) -> _Part:
    """Compacts the shards of the storage ranks ``rank``, ``rank + world``, ... of the chain."""
    entry = chain.entry
    writer = SnapshotWriter(chain.storage, new_id, prefix=f"r{rank}")
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
            writer.add_bytes(app_path(r), chain.readers[-1].app_state(r))
    part = writer.finish()
    for record in out.records:
        prefix = rows_path(record.spec.rank, "")
        record.checksums = {
            logical.removeprefix(prefix): crc
            for logical, crc in part.checksums.items()
            if logical.startswith(f"{prefix}{record.key}.")
        }
    chain.storage.make_durable(new_id)
    knobs.inject_fault(entry.step, rank, phase="compact")
    out.entries = part.entries
    return out


def _commit(chain: ChainReader, new_id: str, parts: list[_Part], target: Target) -> Entry:
    entry = chain.entry
    # Every writer's part is durable: the index goes last.
    write_index(chain.storage, new_id, [p.entries for p in parts], entry.world_size)
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
        restores_before=entry.restores_before,
        interval_decision=entry.interval_decision,
        compacted_from=entry.id,
    )
    append(target, compacted)
    return compacted


def compact_entry(target: Target, step: int | None = None) -> Entry | None:
    """Compacts the chain of a committed checkpoint in this one process (``cnr compact``).

    Returns:
        The compacted checkpoint's entry; ``None`` if that checkpoint already is a lone full one.
    """
    chain = ChainReader(target.storage, step)
    if len(chain.chain) == 1:
        return None
    new_id = checkpoint_id(chain.entry.seq, chain.entry.step, target.generation, compacted=True)
    part = _write_part(chain, new_id, rank=0, world=1)
    return _commit(chain, new_id, [part], target)


def compact(group: Collective, target: Target, every: int | None = None) -> ChainState | None:
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
    latest = manifest.latest()
    if latest is None or len(latest.chain) - 1 < max(every or 1, 1):
        return None
    new_id = checkpoint_id(latest.seq, latest.step, target.generation, compacted=True)
    error: Exception | None = None
    part = None
    try:
        chain = ChainReader(target.storage, latest.step)
        part = _write_part(chain, new_id, group.rank, group.world_size)
    except Exception as e:  # every rank learns of it before anyone commits
        error = e
    group.agree(error)
    parts = group.gather(part)
    group.on_rank0(lambda: _commit(chain, new_id, [p for p in parts if p is not None], target))
    return ChainState([new_id], [])
