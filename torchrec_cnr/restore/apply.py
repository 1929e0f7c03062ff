"""Applying a chain of checkpoints to a live model, mapped by global row ids.

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
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from torchrec_cnr.commit.manifest import Entry, Manifest
from torchrec_cnr.encoding import FP32, ShardRecord, decode_weight
from torchrec_cnr.encoding.codec import dtype_name
from torchrec_cnr.storage import SnapshotReader
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["restore_chain"]


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
        and local.weight.device.type == "cpu"
        and local.weight.is_contiguous()
        and _states_fit(rec, local)
        and all(
            rec.states[name].dtype == dtype_name(state) and state.is_contiguous()
            for name, state in local.states.items()
        )
    )


def _apply_checkpoint(
    reader: SnapshotReader,
    entry: Entry,
    shards: list[LocalShard],
    touched: list[torch.Tensor] | None,
    warned: set[str],
) -> None:
    by_table: dict[str, list[ShardRecord]] = {}
    for rec in entry.shards:
        by_table.setdefault(rec.spec.table, []).append(rec)
    for i, local in enumerate(shards):
        ls = local.spec
        for rec in by_table.get(ls.table, []):
            ss = rec.spec
            rows = _overlap(ls.row_offset, ls.rows, ss.row_offset, ss.rows)
            cols = _overlap(ls.col_offset, ls.cols, ss.col_offset, ss.cols)
            if rows is None or cols is None or rec.saved_rows == 0:
                continue
            if _same_layout(rec, local):
                # A whole fp32 shard saved with this very layout: read it in place.
                reader.rows_into(ss.rank, f"{rec.key}.w", local.weight)
                for name, state in local.states.items():
                    reader.rows_into(ss.rank, rec.states[name].tensor, state)
                if touched is not None:
                    touched[i][:] = True
                continue
            values = decode_weight(partial(reader.rows, ss.rank), rec)
            if rec.all_rows:
                ids = torch.arange(ss.row_offset, ss.row_offset + ss.rows)
            else:
                ids = reader.rows(ss.rank, f"{rec.key}.ids").to(torch.int64)
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
                saved = reader.rows(ss.rank, rec.states[name].tensor)
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


def restore_chain(
    root: Path,
    manifest: Manifest,
    entry: Entry,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    rank: int,
    verify: bool = True,
    scalars: bool = True,
) -> list[torch.Tensor]:
    """Applies ``entry``'s chain to this rank's shards, dense tensors and app_state.

    ``scalars=False`` leaves the kernels' step counters as they are (a partial restore
    goes on from the live step).

    Returns:
        For each local shard, a ``(rows,)`` bool mask of rows that came from a
        delta rather than the baseline.

    Raises:
        CheckpointReadError: a checkpoint file of the chain is missing or unreadable.
        ChecksumError: a stored tensor does not match its recorded checksum.
    """
    chain = [manifest.by_id(i) for i in entry.chain]
    # Open every checkpoint of the chain before writing anything, so a missing
    # one leaves the model untouched.
    readers = [
        SnapshotReader(root / e.id, e.checksums_by_path() if verify else None) for e in chain
    ]
    touched = [torch.zeros(s.spec.rows, dtype=torch.bool, device=s.weight.device) for s in shards]
    warned: set[str] = set()
    for n, (reader, e) in enumerate(zip(readers, chain)):
        with torch.no_grad():
            _apply_checkpoint(reader, e, shards, touched if n > 0 else None, warned)
    if scalars:
        _load_scalars(entry, shards)
    last = readers[-1]
    with torch.no_grad():
        for name, tensor in dense.items():
            tensor.copy_(last.dense(name))
    if app_state:
        if rank < entry.world_size:
            saved = torch.load(io.BytesIO(last.app_state(rank)), weights_only=False)
            for name, obj in app_state.items():
                if name in saved:
                    obj.load_state_dict(saved[name])
                else:
                    warnings.warn(
                        f"app_state {name!r} is not in the checkpoint; left as is", stacklevel=2
                    )
        else:
            warnings.warn(
                f"rank {rank} has no app_state in a checkpoint written by {entry.world_size} ranks; "
                "left as is",
                stacklevel=2,
            )
    return touched
