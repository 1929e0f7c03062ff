"""Applying a chain of checkpoints to a live model, mapped by global row ids.

A restore is all or nothing. :func:`read_chain` reads and verifies every tensor this
rank needs from every checkpoint of the chain before anything changes; only when every
rank has (the manager agrees on it) does :func:`apply_chain` write into the model. Read
tensors are held in host memory up to a budget; past it they are verified and dropped,
then read again (and verified again) while applying.

The chain is applied in order, baseline first, later checkpoints winning. Each saved
shard is scattered into every local shard it overlaps, so a checkpoint restores onto
any sharding and world size: rows map by global row id, columns by global column offset.
Per-element optimizer states map by column like the weights. A per-row state belongs to
a whole saved shard: a local shard takes it from the saved shard that holds its first
column, which is its own former self, and exact, whenever the column split is unchanged.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.commit.manifest import Entry, Manifest
from torchrec_cnr.encoding import FP32, ShardRecord, decode_weight
from torchrec_cnr.encoding.codec import dtype_name
from torchrec_cnr.staging import StagingPool
from torchrec_cnr.storage import SnapshotReader, Storage
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["ChainRead", "apply_chain", "read_chain"]


def _overlap(a0: int, an: int, b0: int, bn: int) -> tuple[int, int] | None:
    lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
    return (lo, hi) if lo < hi else None


def _states_fit(rec: ShardRecord, local: LocalShard) -> bool:
    """Whether the saved optimizer state can be loaded into ``local``'s kernel."""
    return rec.optimizer == local.optimizer and set(rec.states) == set(local.states)


def _same_layout(rec: ShardRecord, local: LocalShard) -> bool:
    ss, ls = rec.spec, local.spec
    return (
        rec.all_rows
        and rec.format == FP32
        and (ss.row_offset, ss.col_offset, ss.rows, ss.cols)
        == (ls.row_offset, ls.col_offset, ls.rows, ls.cols)
        and _states_fit(rec, local)
        and all(rec.states[n].dtype == dtype_name(s) for n, s in local.states.items())
    )


def _pairs(
    entry: Entry, shards: list[LocalShard]
) -> Iterator[tuple[int, LocalShard, ShardRecord, tuple[int, int], tuple[int, int]]]:
    """Each local shard and each saved shard of ``entry`` that holds some of its elements."""
    by_table: dict[str, list[ShardRecord]] = {}
    for rec in entry.shards:
        by_table.setdefault(rec.spec.table, []).append(rec)
    for i, local in enumerate(shards):
        ls = local.spec
        for rec in by_table.get(ls.table, []):
            ss = rec.spec
            rows = _overlap(ls.row_offset, ls.rows, ss.row_offset, ss.rows)
            cols = _overlap(ls.col_offset, ls.cols, ss.col_offset, ss.cols)
            if rows is not None and cols is not None and rec.saved_rows > 0:
                yield i, local, rec, rows, cols


def _needs(rec: ShardRecord, local: LocalShard) -> list[str]:
    """The stored tensors of ``rec`` a restore into ``local`` reads."""
    names = [f"{rec.key}.w"] if rec.format == FP32 else [f"{rec.key}.w.{p}" for p in rec.parts]
    if not rec.all_rows:
        names.append(f"{rec.key}.ids")
    if _states_fit(rec, local):
        names += [rec.states[n].tensor for n in local.states]
    return names


@dataclass
class ChainRead:
    """A chain whose every needed tensor was read and verified, ready to apply."""

    readers: list[SnapshotReader]
    chain: list[Entry]
    cache: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    """(checkpoint index, rank, stored name) -> tensor, for those that fit the budget."""
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    app_blob: bytes | None = None

    def fetch(self, n: int, rank: int, name: str) -> torch.Tensor:
        """A stored tensor: from memory, or read again (and verified again)."""
        cached = self.cache.get((n, rank, name))
        return cached if cached is not None else self.readers[n].rows(rank, name)


def read_chain(
    storage: Storage,
    manifest: Manifest,
    entry: Entry,
    shards: list[LocalShard],
    dense_names: list[str],
    app_rank: int | None,
    verify: bool = True,
    budget_bytes: int | None = None,
    pool: StagingPool | None = None,
) -> ChainRead:
    """Reads and verifies everything a restore of ``entry`` into ``shards`` needs.

    Args:
        dense_names: dense tensors to restore (from the chain's last checkpoint).
        app_rank: this rank, to restore its ``app_state``; ``None`` for none. A rank
            beyond the checkpoint's world size takes that of ``app_rank % world_size``:
            replicated state (the dense optimizer of DDP replicas) is the same on every
            rank, and a fresh one would let this rank's replica drift from the others.
        verify: check every tensor against the checksum recorded at save time.
        budget_bytes: host memory for read tensors; ``None`` keeps every one.
        pool: the staging buffers, to read this rank's own baseline tensors into: a
            fresh gigabyte costs a page fault per 4 KiB, about as long as reading it.

    Raises:
        CheckpointReadError: a checkpoint directory or file of the chain is missing or
            unreadable, or a checkpoint is not in the manifest.
        ChecksumError: a stored tensor does not match its recorded checksum.
    """
    chain = [manifest.by_id(i) for i in entry.chain]
    readers = [
        SnapshotReader(storage, e.id, e.checksums_by_path() if verify else None) for e in chain
    ]
    read = ChainRead(readers, chain)
    held = 0
    for n, e in enumerate(chain):
        wanted = list(
            dict.fromkeys(
                (rec.spec.rank, name)
                for _, local, rec, _, _ in _pairs(e, shards)
                for name in _needs(rec, local)
            )
        )
        if budget_bytes is None:  # hold everything: read it all at once, in parallel
            alloc = None
            if pool is not None and n == 0:
                pool.begin()

                def alloc(key: tuple[int, str], shape: list[int], dtype: torch.dtype) -> Any:
                    own = key[0] == shards[0].spec.rank if shards else False
                    return pool.take(key[1], tuple(shape), dtype) if own else None

            got = readers[n].read_many(wanted, alloc)
            read.cache.update({(n, *k): t for k, t in got.items()})
            continue
        for rank, name in wanted:  # one at a time, keeping what fits the budget
            tensor = readers[n].rows(rank, name)
            nbytes = tensor.numel() * tensor.element_size()
            if held + nbytes <= budget_bytes:
                read.cache[(n, rank, name)] = tensor
                held += nbytes
    read.dense = {name: readers[-1].dense(name) for name in dense_names}
    if app_rank is not None:
        source = app_rank % entry.world_size
        read.app_blob = readers[-1].app_state(source)
        if source != app_rank:
            warnings.warn(
                f"rank {app_rank} takes the app_state of rank {source}: the checkpoint was "
                f"written by {entry.world_size} rank(s)",
                stacklevel=2,
            )
    return read


def _apply_checkpoint(
    read: ChainRead,
    n: int,
    shards: list[LocalShard],
    touched: list[torch.Tensor] | None,
    warned: set[str],
) -> None:
    for i, local, rec, rows, cols in _pairs(read.chain[n], shards):
        ls, ss = local.spec, rec.spec
        fetch = lambda name, rank=ss.rank: read.fetch(n, rank, name)  # noqa: E731
        if _same_layout(rec, local):
            # A whole fp32 shard saved with this very layout: copy it as it is.
            local.weight.copy_(fetch(f"{rec.key}.w"))
            for name, state in local.states.items():
                state.copy_(fetch(rec.states[name].tensor))
            if touched is not None:
                touched[i][:] = True
            continue
        values = decode_weight(fetch, rec)
        if rec.all_rows:
            ids = torch.arange(ss.row_offset, ss.row_offset + ss.rows)
        else:
            ids = fetch(f"{rec.key}.ids").to(torch.int64)
        inside = (ids >= rows[0]) & (ids < rows[1])
        sel: torch.Tensor | None = None
        if not bool(inside.all()):
            sel = inside
            ids, values = ids[sel], values[sel]
        device = local.weight.device
        local_rows = (ids - ls.row_offset).to(device)
        saved_cols = slice(cols[0] - ss.col_offset, cols[1] - ss.col_offset)
        local_cols = slice(cols[0] - ls.col_offset, cols[1] - ls.col_offset)
        dst = local.weight[:, local_cols]
        dst.index_copy_(0, local_rows, values[:, saved_cols].to(device=device, dtype=dst.dtype))
        if touched is not None:
            touched[i][local_rows] = True
        if not _states_fit(rec, local):
            if ls.table not in warned:
                warnings.warn(
                    f"table {ls.table!r}: the checkpoint holds {rec.optimizer} state "
                    f"{sorted(rec.states)}, the model trains with {local.optimizer} "
                    f"{sorted(local.states)}; its weights are restored, its optimizer state "
                    "is left as initialized",
                    stacklevel=3,
                )
                warned.add(ls.table)
            continue
        holds_first_col = ss.col_offset <= ls.col_offset < ss.col_offset + ss.cols
        for name, state in local.states.items():
            per_element = state.dim() == 2
            if not per_element and not holds_first_col:
                continue
            saved = fetch(rec.states[name].tensor)
            if sel is not None:
                saved = saved[sel]
            if per_element:
                state[:, local_cols].index_copy_(
                    0, local_rows, saved[:, saved_cols].to(device=device, dtype=state.dtype)
                )
            else:
                state.index_copy_(0, local_rows, saved.to(device=device, dtype=state.dtype))


def _load_scalars(entry: Entry, shards: list[LocalShard]) -> None:
    """Sets each kernel's step counters to the saved ones of the tables it holds.

    After resharding, a kernel may hold tables that sat in different kernels; those
    counted the same steps, and the largest value is taken.
    """
    by_kernel: dict[int, tuple[LocalShard, dict[str, float]]] = {}
    for local in shards:
        for rec in entry.shards:
            if rec.spec.table != local.spec.table or not _states_fit(rec, local):
                continue
            _, merged = by_kernel.setdefault(id(local.kernel), (local, {}))
            for name, value in rec.scalars.items():
                merged[name] = max(value, merged.get(name, value))
    for local, merged in by_kernel.values():
        local.load_scalar_states(merged)


def apply_chain(
    read: ChainRead,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    scalars: bool = True,
) -> list[torch.Tensor]:
    """Writes a read chain into this rank's shards, dense tensors and ``app_state``.

    ``scalars=False`` leaves the kernels' step counters as they are (a partial restore
    goes on from the live step).

    Returns:
        For each local shard, a ``(rows,)`` bool mask of rows that came from a delta
        rather than the baseline.
    """
    touched = [torch.zeros(s.spec.rows, dtype=torch.bool, device=s.weight.device) for s in shards]
    warned: set[str] = set()
    with torch.no_grad():
        for n in range(len(read.chain)):
            _apply_checkpoint(read, n, shards, touched if n > 0 else None, warned)
        if scalars:
            _load_scalars(read.chain[-1], shards)
        for name, tensor in dense.items():
            tensor.copy_(read.dense[name])
    if app_state and read.app_blob is not None:
        saved = torch.load(io.BytesIO(read.app_blob), weights_only=False)
        for name, obj in app_state.items():
            if name in saved:
                obj.load_state_dict(saved[name])
            else:
                warnings.warn(
                    f"app_state {name!r} is not in the checkpoint; left as is", stacklevel=2
                )
    return touched
