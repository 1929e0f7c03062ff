"""Where a saved shard's elements land in another shard of the same table.

One rule, used by every path that reads a checkpoint into something of another shape
(a restore onto a live model, compaction, reading a table without a model, serving):

- rows map by global row id: a saved row lands in the destination row of the same id;
- columns map by overlap of the global column ranges;
- a per-element optimizer state (``(rows, cols)``) maps like the weights;
- a per-row state (``(rows,)``) belongs to a whole saved shard: a destination takes it
  from the saved shard that holds the destination's first column. Whenever the column
  split is unchanged that is the destination's own former self, and exact;
- optimizer state carries over only between the same optimizer with the same states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from torchrec_cnr.encoding import FP32, ShardRecord, decode_weight
from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.tracking.shard import ShardSpec

__all__ = [
    "Placement",
    "overlap",
    "overlaps",
    "place",
    "scatter",
    "scatter_weight",
    "slot",
    "states_fit",
    "whole_table",
]


def overlap(a0: int, an: int, b0: int, bn: int) -> tuple[int, int] | None:
    """``[lo, hi)`` of two ranges ``[a0, a0 + an)`` and ``[b0, b0 + bn)``; ``None`` if disjoint."""
    lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
    return (lo, hi) if lo < hi else None


def overlaps(a: ShardSpec, b: ShardSpec) -> bool:
    """Whether two shards of one table hold some element in common."""
    return (
        a.table == b.table
        and overlap(a.row_offset, a.rows, b.row_offset, b.rows) is not None
        and overlap(a.col_offset, a.cols, b.col_offset, b.cols) is not None
    )


def whole_table(table: str, num_embeddings: int, embedding_dim: int) -> ShardSpec:
    """A destination that is the whole table (reading a table without a model)."""
    return ShardSpec(
        table, 0, "whole", 0, 0, num_embeddings, embedding_dim, num_embeddings, embedding_dim
    )


def states_fit(rec: ShardRecord, optimizer: str, states: Iterable[str]) -> bool:
    """Whether ``rec``'s saved optimizer state loads into a shard trained by ``optimizer``
    with ``states``."""
    return rec.optimizer == optimizer and set(rec.states) == set(states)


@dataclass(frozen=True)
class Placement:
    """Which of a saved shard's rows land in a destination, and where."""

    keep: torch.Tensor | None
    """``(k,)`` ascending positions in the saved tensors of the rows that land; ``None`` for all."""
    rows: torch.Tensor
    """``(k,)`` their rows in the destination tensor."""
    src_cols: slice
    """The overlapping columns, within the saved shard."""
    dst_cols: slice
    """The same columns, within the destination."""
    owns_row_state: bool
    """The saved shard holds the destination's first column: per-row states come from it."""

    @property
    def count(self) -> int:
        return int(self.rows.numel())

    @property
    def window(self) -> tuple[int, int] | None:
        """Positions ``lo..hi - 1`` of the saved rows, from the first that lands to the last
        (only these need be read); ``None`` if all land."""
        if self.keep is None:
            return None
        return int(self.keep[0]), int(self.keep[-1]) + 1


def place(
    src: ShardSpec,
    saved_ids: torch.Tensor,
    dst: ShardSpec,
    wanted: torch.Tensor | None = None,
) -> Placement | None:
    """Where the saved rows ``saved_ids`` of shard ``src`` land in shard ``dst``.

    Args:
        src: the saved shard.
        saved_ids: ``(n,)`` int64 global ids of the rows it saved, in stored order.
        dst: the destination shard (of the same table).
        wanted: ``(m,)`` ascending global ids: the destination holds only these rows,
            in this order (a read of some rows of a table); ``None`` for all of ``dst``.

    Returns:
        ``None`` if no saved element lands in ``dst``.
    """
    cols = overlap(src.col_offset, src.cols, dst.col_offset, dst.cols)
    if cols is None or overlap(src.row_offset, src.rows, dst.row_offset, dst.rows) is None:
        return None
    if wanted is None:
        inside = (saved_ids >= dst.row_offset) & (saved_ids < dst.row_offset + dst.rows)
        keep = None if bool(inside.all()) else torch.nonzero(inside).flatten()
        ids = saved_ids if keep is None else saved_ids[keep]
        rows = ids - dst.row_offset
    else:
        if not wanted.numel():
            return None
        at = torch.searchsorted(wanted, saved_ids).clamp_max(wanted.numel() - 1)
        keep = torch.nonzero(wanted[at] == saved_ids).flatten()
        rows = at[keep]
    if not rows.numel():
        return None
    return Placement(
        keep=keep,
        rows=rows,
        src_cols=slice(cols[0] - src.col_offset, cols[1] - src.col_offset),
        dst_cols=slice(cols[0] - dst.col_offset, cols[1] - dst.col_offset),
        owns_row_state=src.col_offset <= dst.col_offset < src.col_offset + src.cols,
    )


def slot(out: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``out[name]``, zeros of ``shape`` made there first if absent (never a fresh buffer
    for each saved shard scattered into it: a table's zeros cost a page fault per 4 KiB)."""
    tensor = out.get(name)
    if tensor is None:
        tensor = out[name] = torch.zeros(shape)
    return tensor


def scatter(dst: torch.Tensor, where: Placement, saved: torch.Tensor) -> bool:
    """Writes the landing part of a saved tensor into ``dst``, converting its dtype.

    ``dst`` and ``saved`` are both ``(rows, cols)`` (weights, per-element states) or both
    ``(rows,)`` (a per-row state, written only where the saved shard owns it).
    ``saved`` may hold every saved row or only ``where.keep``'s.

    Returns:
        Whether anything was written.
    """
    if saved.shape[0] != where.count and where.keep is not None:
        saved = saved[where.keep]
    rows = where.rows.to(dst.device)
    if dst.dim() == 2:
        part = saved[:, where.src_cols].to(device=dst.device, dtype=dst.dtype)
        put_rows(dst[:, where.dst_cols], rows, part)
        return True
    if not where.owns_row_state:
        return False
    put_rows(dst, rows, saved.to(device=dst.device, dtype=dst.dtype))
    return True


DECODE_BYTES = 8 << 20
"""fp32 bytes of rows :func:`scatter_weight` decodes at once: small enough for malloc to
recycle (a whole 1M x 64 shard decoded at once was a fresh 256 MB tensor, page-faulted in
on every restore) and to stay in cache on its way to the destination."""


def scatter_weight(
    dst: torch.Tensor,
    where: Placement,
    rec: ShardRecord,
    read: Callable[[str], torch.Tensor],
    executor: Executor | None = None,
) -> None:
    """Writes the rows of saved shard ``rec`` that land in ``dst`` (``(rows, cols)``),
    decoded to fp32: quantized rows are decoded piece by piece straight into place, the
    pieces on ``executor``'s threads if given. ``read(name)`` gives a stored tensor of
    ``rec``, all its saved rows."""
    if rec.format == FP32:
        scatter(dst, where, read(rec.weight_name(rec.key)))
        return
    parts = {name: read(name) for name in rec.value_names}
    count = where.count
    step = max(1, DECODE_BYTES // max(1, 4 * rec.spec.cols))

    def piece(j0: int) -> None:
        j1 = min(j0 + step, count)
        keep = None if where.keep is None else where.keep[j0:j1]
        a, b = (j0, j1) if keep is None else (int(keep[0]), int(keep[-1]) + 1)
        values = decode_weight(lambda name: parts[name][a:b], rec)
        if keep is not None:
            values = values[keep - a]
        part = values[:, where.src_cols].to(device=dst.device, dtype=dst.dtype)
        put_rows(dst[:, where.dst_cols], where.rows[j0:j1].to(dst.device), part)

    starts = range(0, count, step)
    if executor is None or len(starts) < 2:
        for j0 in starts:
            piece(j0)
        return
    for future in [executor.submit(piece, j0) for j0 in starts]:
        future.result()
