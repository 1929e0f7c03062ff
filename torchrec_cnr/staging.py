"""Stage 3: copy what a checkpoint needs out of the live model into host memory.

Check-N-Run (NSDI'22, Sec. 4.1) decouples checkpointing from training: this is the
only part of a save that stalls training. After :func:`stage` returns, training may
modify the model freely; the staged tensors are the checkpoint.

Each shard goes to a :class:`Sink` (the writer) as soon as it is staged, so the writes of
the first shards overlap the copy of the others. Buffers come from a
:class:`StagingPool`, reused across checkpoints and faulted in when the manager is built
(:meth:`StagingPool.prefault`): fresh host memory costs a page fault per 4 KiB on first
touch, which would double the stall.

``staging_memory_mb`` bounds the host memory a save holds. A checkpoint that fits is
staged whole and written in the background. One that does not is staged in chunks of
rows that fit: each chunk is written, and waited for, before the next is copied into the
same buffers, so the stall grows while memory does not.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from torchrec_cnr.selection.policy import Kind
from torchrec_cnr.snapshot.layout import stored_ids, stored_state, stored_weight
from torchrec_cnr.tracking.shard import LocalShard

_INT32_MAX = 2**31 - 1


class StagingPool:
    """Host buffers keyed by role, reused across checkpoints within a byte budget.

    Args:
        budget_bytes: most bytes the pool holds; ``None`` for no limit.
        pin: allocate page-locked memory (CUDA sources only), so device-to-host
            copies run asynchronously at full bandwidth.
    """

    def __init__(self, budget_bytes: int | None = None, pin: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}
        self._in_use: set[str] = set()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def begin(self) -> None:
        """A new checkpoint: buffers it does not take may be given up for ones it does."""
        self._in_use.clear()

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` tensor whose storage may be reused by the next checkpoint."""
        numel = 1
        for d in shape:
            numel *= d
        self._in_use.add(key)
        buf = self._buffers.get(key)
        if buf is not None and buf.dtype == dtype and buf.numel() >= numel:
            return buf[:numel].view(shape)
        self._buffers.pop(key, None)
        # Without a budget, grow with headroom: deltas grow from one checkpoint to the
        # next. Within one, take exactly what is asked: the buffers a checkpoint takes
        # after this one need the rest of the budget (stage() sizes chunks to fit it).
        want = numel if self.budget_bytes is not None else int(numel * 1.25)
        if self.budget_bytes is not None:
            for stale in [k for k in self._buffers if k not in self._in_use]:
                if self.nbytes + want * dtype.itemsize <= self.budget_bytes:
                    break
                del self._buffers[stale]
        buf = torch.empty(want, dtype=dtype, pin_memory=self.pin)
        self._buffers[key] = buf
        return buf[:numel].view(shape)

    def release(self) -> None:
        """Gives every buffer back; the next checkpoint allocates afresh."""
        self._buffers.clear()
        self._in_use.clear()

    def prefault(self, shards: list[LocalShard]) -> None:
        """Allocates and touches the buffers a full checkpoint of ``shards`` will take."""
        self.begin()
        for key, shape, dtype in _buffers_of(shards, self.budget_bytes):
            self.take(key, shape, dtype).zero_()


@dataclass
class StagedShard:
    """Rows of one shard (or a chunk of them), copied to host memory."""

    shard: LocalShard
    key: str
    ids: torch.Tensor | None
    """``(n,)`` global row ids, or ``None`` when every row of the shard is staged."""
    weight: torch.Tensor
    """``(n, cols)`` row values."""
    states: dict[str, torch.Tensor]
    """Optimizer states of the staged rows, each ``(n,)`` or ``(n, cols)``."""
    scalars: dict[str, float]
    """The kernel's step counters at staging time (see ``LocalShard.scalar_states``)."""
    first_row: int = 0
    """Local row of the first staged row when ``ids`` is ``None`` (a chunk of a full save)."""
    recent: torch.Tensor | None = None
    """``(k,)`` global ids of the shard's stored rows modified since the last checkpoint,
    when they are not all of them (given with a shard's first chunk only)."""

    def global_rows(self) -> torch.Tensor | int:
        """The table row of each staged row: ``(n,)`` ids, or the first row's when the
        staged rows are consecutive."""
        return self.ids if self.ids is not None else self.shard.spec.row_offset + self.first_row

    @property
    def nbytes(self) -> int:
        tensors = [self.weight, *self.states.values()] + (
            [self.ids] if self.ids is not None else []
        )
        return sum(t.numel() * t.element_size() for t in tensors)


class Sink(Protocol):
    """Where staged shards go: the writer of this checkpoint."""

    def add(self, shard: StagedShard, row0: int = 0, total: int | None = None) -> None:
        """Takes ``shard``, whose rows start at ``row0`` of ``total`` (all if ``None``)."""

    def wait(self) -> None:
        """Returns once every shard taken so far is written: its buffers may be reused."""


@dataclass
class StagedCheckpoint:
    """What one rank's checkpoint holds besides its shards, which went to the sink."""

    step: int
    kind: Kind
    dense: dict[str, torch.Tensor]
    app_state: bytes
    staged_bytes: int
    """Bytes of shards staged (chunks count once each)."""
    stall_s: float = 0.0
    """How long training was blocked to stage it, set once staging is done."""


def _ids_dtype(shard: LocalShard) -> torch.dtype:
    return torch.int32 if shard.spec.num_embeddings <= _INT32_MAX else torch.int64


def _chunk_rows(shard: LocalShard, with_ids: bool, budget: int | None) -> int | None:
    """Rows per chunk within ``budget``; ``None`` for no chunking."""
    return None if budget is None else max(1, budget // shard.row_bytes(with_ids))


def _buffers_of(
    shards: list[LocalShard], budget: int | None
) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """The pool buffers a full checkpoint takes: one set per shard, or one chunk set."""
    full = sum(s.spec.rows * s.row_bytes(False) for s in shards)
    chunked = budget is not None and full > budget
    for i, s in enumerate(shards):
        rows = min(s.spec.rows, _chunk_rows(s, False, budget) or s.spec.rows)
        key = "chunk" if chunked else f"s{i}"
        yield stored_weight(key), (rows, *s.weight.shape[1:]), s.weight.dtype
        for name, state in s.states.items():
            yield stored_state(key, name), (rows, *state.shape[1:]), state.dtype


def _gather(
    src: torch.Tensor, rows: torch.Tensor | slice | None, key: str, pool: StagingPool
) -> torch.Tensor:
    """Copies ``src[rows]`` (all of ``src`` if ``rows`` is None) into a pooled host buffer."""
    src = src.detach()
    if isinstance(rows, slice):
        src, rows = src[rows], None
    n = src.shape[0] if rows is None else rows.numel()
    out = pool.take(key, (n, *src.shape[1:]), src.dtype)
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
    shard: LocalShard,
    key: str,
    rows: torch.Tensor | slice | None,
    pool: StagingPool,
    buffers: str | None = None,
    recent: torch.Tensor | None = None,
) -> StagedShard:
    """Copies ``rows`` of ``shard`` and their optimizer state into pooled buffers.

    Args:
        shard: the live shard.
        key: its name inside the checkpoint.
        rows: ``(k,)`` ascending local rows, from
            :func:`~torchrec_cnr.selection.rows.select_rows`; a slice for a block of
            every row (a chunk of a full save); ``None`` for every row.
        pool: where the host buffers come from.
        buffers: the pool keys' prefix; ``key`` if ``None``.
        recent: ``(k,)`` local rows modified since the last checkpoint, if not every
            stored row (see :func:`~torchrec_cnr.selection.rows.select_recent`).
    """
    spec = shard.spec
    ids = None
    prefix = buffers or key
    if isinstance(rows, torch.Tensor):
        ids = pool.take(stored_ids(prefix), (rows.numel(),), _ids_dtype(shard))
        ids.copy_(rows)
        ids += spec.row_offset
    # Buffers are keyed by the stored names, so that a restore reads a baseline straight
    # into the buffers its save staged (their pages are faulted in already).
    weight = _gather(shard.weight, rows, stored_weight(prefix), pool)
    states = {n: _gather(s, rows, stored_state(prefix, n), pool) for n, s in shard.states.items()}
    if shard.weight.device.type == "cuda":
        torch.cuda.current_stream(shard.weight.device).synchronize()  # the copies must land
    first = rows.start or 0 if isinstance(rows, slice) else 0
    changed = None if recent is None else (recent + spec.row_offset).to(_ids_dtype(shard))
    return StagedShard(shard, key, ids, weight, states, shard.scalar_states(), first, changed)


def serialize_app_state(app_state: Mapping[str, Any]) -> bytes:
    """``torch.save`` of ``{name: obj.state_dict()}``; stored as one object per rank."""
    buf = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in app_state.items()}, buf)
    return buf.getvalue()


def stage(
    step: int,
    kind: Kind,
    shards: list[LocalShard],
    rows: list[torch.Tensor | None],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    pool: StagingPool,
    sink: Sink,
    recent: list[torch.Tensor | None] | None = None,
) -> StagedCheckpoint:
    """Stages a checkpoint of ``kind`` at ``step`` into ``sink``: each shard's ``rows``
    (every row where ``None``) and which of them changed since the last checkpoint
    (``recent``, see :func:`~torchrec_cnr.selection.rows.select_recent`), then the dense
    state and the serialized ``app_state``."""
    changed = recent if recent is not None else [None] * len(shards)
    for kernel in {id(s.kernel): s.kernel for s in shards}.values():
        kernel.flush()  # caching kernels write their cache back first
    pool.begin()
    budget = pool.budget_bytes
    need = sum(
        (s.spec.rows if r is None else r.numel()) * s.row_bytes(r is not None)
        for s, r in zip(shards, rows)
    )
    chunked = budget is not None and need > budget
    staged_bytes = 0
    for i, (shard, r) in enumerate(zip(shards, rows)):
        if not chunked:
            staged = stage_shard(shard, f"s{i}", r, pool, recent=changed[i])
            staged_bytes += staged.nbytes
            sink.add(staged)
            continue
        total = shard.spec.rows if r is None else r.numel()
        step_rows = _chunk_rows(shard, r is not None, budget) or total
        for row0 in range(0, max(total, 1), step_rows):
            block = slice(row0, min(row0 + step_rows, total))
            part: torch.Tensor | slice = block if r is None else r[block]
            first_chunk = changed[i] if row0 == 0 else None
            staged = stage_shard(shard, f"s{i}", part, pool, "chunk", first_chunk)
            staged_bytes += staged.nbytes
            sink.add(staged, row0, total)
            sink.wait()  # the next chunk reuses these buffers
    host_dense = {k: v.detach().to("cpu", copy=True) for k, v in dense.items()}
    return StagedCheckpoint(step, kind, host_dense, serialize_app_state(app_state), staged_bytes)
