"""Restore: apply a chain of checkpoints to a live model, mapped by global row ids.

The chain is applied in order, baseline first, later checkpoints winning. Each
saved shard is scattered into every local shard it overlaps, so a checkpoint
restores onto any sharding and world size: rows map by global row id, columns
by global column offset.

Per-row optimizer state belongs to a shard, not to a column range. A local
shard takes it from the saved shard that holds its first column; with the same
sharding that is its own former self and the restore is exact.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchrec_cnr.encoding import decode_weight
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.tracking.tracker import LocalShard
from torchrec_cnr.writer import SnapshotReader


class ModelMismatchError(ValueError):
    """The checkpoint was written by a model with other tables or dense tensors."""


def model_signature(shards: list[LocalShard]) -> dict[str, dict[str, int]]:
    """``table -> {"num_embeddings", "embedding_dim"}`` of the local shards."""
    return {
        s.spec.table: {
            "num_embeddings": s.spec.num_embeddings,
            "embedding_dim": s.spec.embedding_dim,
        }
        for s in shards
    }


def dense_signature(dense: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        for k, v in dense.items()
    }


def check_compatible(
    entry: dict[str, Any],
    tables: dict[str, dict[str, int]],
    dense: dict[str, dict[str, Any]],
    root: str,
) -> None:
    """Raises :class:`ModelMismatchError` naming every difference between model and checkpoint."""
    problems = []
    saved_tables, saved_dense = entry["tables"], entry["dense"]
    for name in sorted(set(saved_tables) | set(tables)):
        if name not in tables:
            problems.append(f"table {name!r} is in the checkpoint but not in the model")
        elif name not in saved_tables:
            problems.append(f"table {name!r} is in the model but not in the checkpoint")
        elif saved_tables[name] != tables[name]:
            s, m = saved_tables[name], tables[name]
            problems.append(
                f"table {name!r} is {s['num_embeddings']}x{s['embedding_dim']} in the checkpoint "
                f"but {m['num_embeddings']}x{m['embedding_dim']} in the model"
            )
    for name in sorted(set(saved_dense) | set(dense)):
        if name not in dense:
            problems.append(f"dense tensor {name!r} is in the checkpoint but not in the model")
        elif name not in saved_dense:
            problems.append(f"dense tensor {name!r} is in the model but not in the checkpoint")
        elif saved_dense[name] != dense[name]:
            problems.append(
                f"dense tensor {name!r} is {saved_dense[name]} in the checkpoint but {dense[name]} in the model"
            )
    if problems:
        raise ModelMismatchError(
            f"checkpoint of step {entry['step']} in {root} does not match the model:\n  "
            + "\n  ".join(problems)
        )


def _overlap(a0: int, an: int, b0: int, bn: int) -> tuple[int, int] | None:
    lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
    return (lo, hi) if lo < hi else None


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _states_fit(rec: dict[str, Any], local: LocalShard) -> bool:
    """Whether the saved optimizer state can be loaded into ``local``'s kernel."""
    return rec["optimizer"] == local.optimizer and set(rec["states"]) == set(local.states)


def _same_layout(rec: dict[str, Any], local: LocalShard) -> bool:
    ss, ls = rec["spec"], local.spec
    return (
        rec["all_rows"]
        and rec["format"]["method"] == "none"
        and (ss["row_offset"], ss["col_offset"], ss["rows"], ss["cols"])
        == (ls.row_offset, ls.col_offset, ls.rows, ls.cols)
        and local.weight.device.type == "cpu"
        and local.weight.is_contiguous()
        and _states_fit(rec, local)
        and all(
            rec["states"][name]["dtype"] == _dtype_name(state) and state.is_contiguous()
            for name, state in local.states.items()
        )
    )


def _apply_checkpoint(
    reader: SnapshotReader,
    entry: dict[str, Any],
    shards: list[LocalShard],
    touched: list[torch.Tensor] | None,
    warned: set[str],
) -> None:
    by_table: dict[str, list[dict[str, Any]]] = {}
    for rec in entry["shards"]:
        by_table.setdefault(rec["spec"]["table"], []).append(rec)
    for i, local in enumerate(shards):
        ls = local.spec
        for rec in by_table.get(ls.table, []):
            ss = rec["spec"]
            rows = _overlap(ls.row_offset, ls.rows, ss["row_offset"], ss["rows"])
            cols = _overlap(ls.col_offset, ls.cols, ss["col_offset"], ss["cols"])
            if rows is None or cols is None or rec["saved_rows"] == 0:
                continue
            key, rank = rec["key"], ss["rank"]
            if _same_layout(rec, local):
                # A whole fp32 shard saved with this very layout: read it in place.
                reader.rows_into(rank, f"{key}.w", local.weight)
                for name, state in local.states.items():
                    reader.rows_into(rank, rec["states"][name]["tensor"], state)
                if touched is not None:
                    touched[i][:] = True
                continue
            values = decode_weight(lambda name, rank=rank: reader.rows(rank, name), rec)
            if rec["all_rows"]:
                ids = torch.arange(ss["row_offset"], ss["row_offset"] + ss["rows"])
            else:
                ids = reader.rows(rank, f"{key}.ids").to(torch.int64)
            inside = (ids >= rows[0]) & (ids < rows[1])
            sel: torch.Tensor | None = None
            if not bool(inside.all()):
                sel = inside
                ids, values = ids[sel], values[sel]
            device = local.weight.device
            local_rows = (ids - ls.row_offset).to(device)
            saved_cols = slice(cols[0] - ss["col_offset"], cols[1] - ss["col_offset"])
            local_cols = slice(cols[0] - ls.col_offset, cols[1] - ls.col_offset)
            dst = local.weight[:, local_cols]
            dst.index_copy_(0, local_rows, values[:, saved_cols].to(device=device, dtype=dst.dtype))
            if touched is not None:
                touched[i][local_rows] = True
            if not _states_fit(rec, local):
                if ls.table not in warned:
                    warnings.warn(
                        f"table {ls.table!r}: the checkpoint holds {rec['optimizer']} state "
                        f"{sorted(rec['states'])}, the model trains with {local.optimizer} "
                        f"{sorted(local.states)}; its weights are restored, its optimizer state "
                        "is left as initialized",
                        stacklevel=3,
                    )
                    warned.add(ls.table)
                continue
            # Per-element states map by column like the weights. A per-row state belongs to a
            # whole saved shard: it comes from the one holding the local shard's first column.
            holds_first_col = ss["col_offset"] <= ls.col_offset < ss["col_offset"] + ss["cols"]
            for name, state in local.states.items():
                per_element = state.dim() == 2
                if not per_element and not holds_first_col:
                    continue
                saved = reader.rows(rank, rec["states"][name]["tensor"])
                if sel is not None:
                    saved = saved[sel]
                if per_element:
                    state[:, local_cols].index_copy_(
                        0, local_rows, saved[:, saved_cols].to(device=device, dtype=state.dtype)
                    )
                else:
                    state.index_copy_(0, local_rows, saved.to(device=device, dtype=state.dtype))


def _load_scalars(entry: dict[str, Any], shards: list[LocalShard]) -> None:
    """Sets each kernel's step counters to the saved ones of the tables it holds.

    After resharding, a kernel may hold tables that sat in different kernels; those
    counted the same steps, and the largest value is taken.
    """
    by_kernel: dict[int, tuple[LocalShard, dict[str, float]]] = {}
    for local in shards:
        for rec in entry["shards"]:
            if rec["spec"]["table"] != local.spec.table or not _states_fit(rec, local):
                continue
            _, merged = by_kernel.setdefault(id(local.kernel), (local, {}))
            for name, value in rec.get("scalars", {}).items():
                merged[name] = max(value, merged.get(name, value))
    for local, merged in by_kernel.values():
        local.load_scalar_states(merged)


def restore_chain(
    root: Path,
    manifest: Manifest,
    entry: dict[str, Any],
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
    chain = [manifest.by_id(i) for i in entry["chain"]]
    # Open every checkpoint of the chain before writing anything, so a missing
    # one leaves the model untouched.
    readers = [SnapshotReader(root / e["id"], e if verify else None) for e in chain]
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
        if rank < entry["world_size"]:
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
                f"rank {rank} has no app_state in a checkpoint written by {entry['world_size']} ranks; "
                "left as is",
                stacklevel=2,
            )
    return touched
