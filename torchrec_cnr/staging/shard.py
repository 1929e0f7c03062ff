"""What a staged shard is, and the copy of one shard's rows into pooled host buffers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from torchrec_cnr.schema import ShardSpec, stored_ids, stored_state, stored_weight
from torchrec_cnr.selection.policy import Kind
from torchrec_cnr.staging.pool import StagingPool
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.shard import LocalShard

_INT32_MAX = 2**31 - 1


class ShardSource(Protocol):
    """What encoding reads of the shard rows were staged from (a :class:`LocalShard`, or
    its description in the writer process)."""

    @property
    def spec(self) -> ShardSpec: ...

    @property
    def optimizer(self) -> str: ...


@dataclass(frozen=True)
class SourceInfo:
    """A :class:`ShardSource` as data: what the writer process is told of a shard."""

    spec: ShardSpec
    optimizer: str


@dataclass(frozen=True)
class RecentBits:
    """The rows of a shard modified since the previous checkpoint, as lazy staging copies
    them at ``save()``: a bitmap of its local rows, turned into ids by the encoder, off the
    training process's GIL where the writer is a process of its own."""

    words: torch.Tensor
    num_rows: int


@dataclass
class StagedShard:
    """Rows of one shard (or a chunk of them), copied to host memory."""

    shard: ShardSource
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
    recent: torch.Tensor | RecentBits | None = None
    """``(k,)`` global ids of the shard's stored rows modified since the last checkpoint
    (or their bitmap), when they are not all of them (given with a shard's first chunk only)."""
    tail: bool = False
    """The shard's last ``k`` stored rows are ``recent``'s (see
    :func:`~torchrec_cnr.selection.rows.tail_order`)."""

    def recent_ids(self) -> torch.Tensor | None:
        """``recent`` as ``(k,)`` global ids."""
        if isinstance(self.recent, RecentBits):
            changed = bitmap.to_indices(self.recent.words, self.recent.num_rows)
            return global_ids(self.shard, changed)
        return self.recent

    def global_rows(self) -> torch.Tensor | int:
        """The table row of each staged row: ``(n,)`` ids, or the first row's when the
        staged rows are consecutive."""
        return self.ids if self.ids is not None else self.shard.spec.row_offset + self.first_row

    def rows(self, a: int, b: int) -> StagedShard:
        """Staged rows ``a`` to ``b`` (views): a chunk of these rows, ``recent`` with the
        first one only."""
        return StagedShard(
            self.shard,
            self.key,
            None if self.ids is None else self.ids[a:b],
            self.weight[a:b],
            {k: v[a:b] for k, v in self.states.items()},
            self.scalars,
            self.first_row + a,
            self.recent if a == 0 else None,
            self.tail,
        )

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

    def start(self) -> None:
        """Starts encoding and writing what it has taken (lazy staging calls it per shard)."""

    def wait(self) -> None:
        """Returns once every shard taken so far is written: its buffers may be reused."""

    def abandon(self) -> None:
        """Drops whatever it has taken: staging failed."""


class RecordingSink:
    """A sink that keeps what it is given: with ``background="process"``, the training
    process's side of a checkpoint's writer, which hands the shards on to the writer
    process (:mod:`torchrec_cnr.writer_process`)."""

    def __init__(self, ckpt_id: str) -> None:
        self.ckpt_id = ckpt_id
        self.added: list[tuple[StagedShard, int, int | None]] = []

    def add(self, shard: StagedShard, row0: int = 0, total: int | None = None) -> None:
        self.added.append((shard, row0, total))

    def start(self) -> None:
        pass

    def wait(self) -> None:  # only chunked staging waits, which a process writer refuses
        raise RuntimeError("a recording sink writes nothing to wait for")

    def abandon(self) -> None:
        self.added.clear()


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
    saved_at: float = field(default_factory=time.time)
    """When it was staged (seconds since the epoch)."""
    rest: Callable[[Sink], None] | None = None
    """Copies the rows staged lazily into the sink (see :mod:`~torchrec_cnr.staging.lazy`);
    the writer calls it first."""


def ids_dtype(shard: ShardSource) -> torch.dtype:
    return torch.int32 if shard.spec.num_embeddings <= _INT32_MAX else torch.int64


def global_ids(
    shard: ShardSource, rows: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The table ids of ``shard``'s local ``rows``, as a checkpoint stores them (into
    ``out`` if given)."""
    if out is None:  # on the host, whatever device ``rows`` is on
        return (rows.cpu() + shard.spec.row_offset).to(ids_dtype(shard))
    out.copy_(rows)
    out += shard.spec.row_offset
    return out


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
    else:  # gathered on the device (the rows may come from a host bitmap)
        picked = src if rows is None else src.index_select(0, rows.to(src.device))
        out.copy_(picked, non_blocking=True)
    return out


def stage_shard(
    shard: LocalShard,
    key: str,
    rows: torch.Tensor | slice | None,
    pool: StagingPool,
    buffers: str | None = None,
    recent: torch.Tensor | None = None,
    tail: bool = False,
) -> StagedShard:
    """Copies ``rows`` of ``shard`` and their optimizer state into pooled buffers.

    Args:
        shard: the live shard.
        key: its name inside the checkpoint.
        rows: ``(k,)`` local rows in the order the checkpoint stores them (see
            :func:`~torchrec_cnr.selection.rows.tail_order`); a slice for a block of
            every row (a chunk of a full save); ``None`` for every row.
        pool: where the host buffers come from.
        buffers: the pool keys' prefix; ``key`` if ``None``.
        recent: ``(k,)`` local rows modified since the last checkpoint, if not every
            stored row (see :func:`~torchrec_cnr.selection.rows.select_recent`).
        tail: the shard's last stored rows are ``recent``.
    """
    ids = None
    prefix = buffers or key
    if isinstance(rows, torch.Tensor):
        ids = global_ids(
            shard, rows, pool.take(stored_ids(prefix), (rows.numel(),), ids_dtype(shard))
        )
    # Buffers are keyed by the stored names, so that a restore reads a baseline straight
    # into the buffers its save staged (their pages are faulted in already).
    weight = _gather(shard.weight, rows, stored_weight(prefix), pool)
    states = {n: _gather(s, rows, stored_state(prefix, n), pool) for n, s in shard.states.items()}
    if shard.weight.device.type == "cuda":
        torch.cuda.current_stream(shard.weight.device).synchronize()  # the copies must land
    first = rows.start or 0 if isinstance(rows, slice) else 0
    changed = None if recent is None else global_ids(shard, recent)
    return StagedShard(shard, key, ids, weight, states, shard.scalar_states(), first, changed, tail)
