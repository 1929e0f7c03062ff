"""Staging: copy what a checkpoint needs out of the live model into host memory.

This is the only part of a save that stalls training. After :func:`stage`
returns, training may modify the model freely; the staged tensors are the
checkpoint. Buffers come from a :class:`StagingPool` and are reused across
checkpoints: fresh host memory costs a page fault per 4 KiB on first touch,
which would double the stall.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.tracker import LocalShard

_INT32_MAX = 2**31 - 1


class StagingPool:
    """Host buffers keyed by role, reused across checkpoints within a byte budget.

    Args:
        budget_bytes: most bytes the pool keeps between checkpoints; ``None`` for no limit.
            A request beyond it gets a one-off buffer.
        pin: allocate page-locked memory (CUDA sources only), so device-to-host
            copies run asynchronously at full bandwidth.
    """

    def __init__(self, budget_bytes: int | None = None, pin: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` tensor whose storage may be reused by the next checkpoint."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._buffers.get(key)
        if buf is not None and buf.dtype == dtype and buf.numel() >= numel:
            return buf[:numel].view(shape)
        # Grow with headroom: deltas grow from one checkpoint to the next.
        want = max(numel, int(numel * 1.25)) if numel else 0
        old = buf.numel() * buf.element_size() if buf is not None else 0
        fits = (
            self.budget_bytes is None
            or self.nbytes - old + want * dtype.itemsize <= self.budget_bytes
        )
        if not fits:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        buf = torch.empty(want, dtype=dtype, pin_memory=self.pin)
        self._buffers[key] = buf
        return buf[:numel].view(shape)


@dataclass
class StagedShard:
    """Rows of one shard, copied to host memory."""

    shard: LocalShard
    key: str
    ids: torch.Tensor | None
    """``(n,)`` global row ids, or ``None`` when every row is staged."""
    weight: torch.Tensor
    """``(n, cols)`` row values."""
    states: dict[str, torch.Tensor]
    """Optimizer states of the staged rows, each ``(n,)`` or ``(n, cols)``."""
    scalars: dict[str, float]
    """The kernel's step counters at staging time (see ``LocalShard.scalar_states``)."""

    @property
    def nbytes(self) -> int:
        tensors = [self.weight, *self.states.values()] + (
            [self.ids] if self.ids is not None else []
        )
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StagedCheckpoint:
    """Everything one rank writes for one checkpoint."""

    step: int
    kind: str
    shards: list[StagedShard]
    dense: dict[str, torch.Tensor]
    app_state: bytes

    @property
    def nbytes(self) -> int:
        dense = sum(t.numel() * t.element_size() for t in self.dense.values())
        return sum(s.nbytes for s in self.shards) + dense + len(self.app_state)


def _gather_rows(
    src: torch.Tensor, rows: torch.Tensor | None, out_key: str, pool: StagingPool
) -> torch.Tensor:
    """Copies ``src[rows]`` (all of ``src`` if ``rows`` is None) into a pooled host buffer."""
    src = src.detach()
    n = src.shape[0] if rows is None else rows.numel()
    out = pool.take(out_key, (n, *src.shape[1:]), src.dtype)
    if src.device.type == "cpu":
        if rows is None:
            out.copy_(src)
        else:
            torch.index_select(src, 0, rows, out=out)
    else:
        picked = src if rows is None else src.index_select(0, rows)
        out.copy_(picked, non_blocking=True)
    return out


def stage_shard(
    shard: LocalShard, key: str, full: bool, pool: StagingPool, rows: torch.Tensor | None = None
) -> StagedShard:
    """Copies the rows of ``shard`` that the checkpoint holds.

    Args:
        shard: the live shard.
        key: its name inside the snapshot.
        full: stage every row, not only the modified ones.
        pool: where the host buffers come from.
        rows: stage exactly these local rows (a prioritized selection) instead.
    """
    spec = shard.spec
    if rows is None and not full and shard.words is not None:
        rows = bitmap.to_indices(shard.words, spec.rows)
    if rows is not None and rows.numel() == spec.rows:
        rows = None
    ids = None
    if rows is not None:
        ids_dtype = torch.int32 if spec.num_embeddings <= _INT32_MAX else torch.int64
        ids = (rows + spec.row_offset).to(device="cpu", dtype=ids_dtype)
    weight = _gather_rows(shard.weight, rows, f"{key}.w", pool)
    states = {n: _gather_rows(s, rows, f"{key}.{n}", pool) for n, s in shard.states.items()}
    return StagedShard(shard, key, ids, weight, states, shard.scalar_states())


def serialize_app_state(app_state: Mapping[str, Any]) -> bytes:
    """``torch.save`` of ``{name: obj.state_dict()}``; stored as one object per rank."""
    buf = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in app_state.items()}, buf)
    return buf.getvalue()


def _row_bytes(shard: LocalShard) -> int:
    states = sum(s[0].numel() * s.element_size() for s in shard.states.values() if s.shape[0])
    return shard.weight.shape[1] * shard.weight.element_size() + states + 4


def prioritize(shards: list[LocalShard], budget_bytes: int) -> list[torch.Tensor]:
    """CPR's prioritized save: the modified rows with the highest priority that fit the budget.

    Priority is the access count (MFU) or whether a sampled lookup touched the
    row (SSU, ties broken by row order). Rows are ranked across all of this
    rank's shards.

    Returns:
        For each shard, the ``(k,)`` ascending local rows to save.
    """
    cand, scores, costs, owner = [], [], [], []
    for i, shard in enumerate(shards):
        assert shard.words is not None and shard.priority is not None, (
            "prioritized saves need mfu/ssu tracking"
        )
        rows = bitmap.to_indices(shard.words, shard.spec.rows)
        if shard.priority.dtype == torch.int64:  # SSU: sampled-row bitmap
            score = bitmap.to_mask(shard.priority, shard.spec.rows)[rows].to(torch.float64)
        else:  # MFU: access counts
            score = shard.priority[rows].to(torch.float64)
        cand.append(rows)
        scores.append(score)
        costs.append(torch.full_like(score, float(_row_bytes(shard))))
        owner.append(torch.full_like(rows, i))
    if not cand:
        return []
    order = torch.argsort(torch.cat(scores), descending=True, stable=True)
    keep = order[torch.cumsum(torch.cat(costs)[order], 0) <= budget_bytes]
    rows_all, owner_all = torch.cat(cand)[keep], torch.cat(owner)[keep]
    return [rows_all[owner_all == i].sort().values for i in range(len(shards))]


def stage(
    step: int,
    kind: str,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    pool: StagingPool,
    selected: list[torch.Tensor] | None = None,
) -> StagedCheckpoint:
    """Stages a checkpoint of ``kind`` (``"full"`` or ``"delta"``) at ``step``.

    ``selected`` gives each shard's rows for a prioritized delta (see :func:`prioritize`).
    """
    staged = [
        stage_shard(s, f"s{i}", kind == "full", pool, None if selected is None else selected[i])
        for i, s in enumerate(shards)
    ]
    host_dense = {k: v.detach().to("cpu", copy=True) for k, v in dense.items()}
    if any(s.weight.device.type == "cuda" for s in shards):
        torch.cuda.synchronize()  # the non-blocking copies above must land before training resumes
    return StagedCheckpoint(step, kind, staged, host_dense, serialize_app_state(app_state))
