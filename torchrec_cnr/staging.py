"""Stage 3: copy what a checkpoint needs out of the live model into host memory.

Check-N-Run (NSDI'22, Sec. 4.1) decouples checkpointing from training: this is the
only part of a save that stalls training. After :func:`stage`
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

from torchrec_cnr.selection.policy import Kind
from torchrec_cnr.tracking.shard import LocalShard

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
    kind: Kind
    shards: list[StagedShard]
    dense: dict[str, torch.Tensor]
    app_state: bytes
    stall_s: float = 0.0
    """How long training was blocked to stage it, set once staging is done."""

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
    shard: LocalShard, key: str, rows: torch.Tensor | None, pool: StagingPool
) -> StagedShard:
    """Copies ``rows`` of ``shard`` (every row if ``None``) and their optimizer state.

    Args:
        shard: the live shard.
        key: its name inside the checkpoint.
        rows: ``(k,)`` ascending local rows, from :func:`~torchrec_cnr.selection.rows.select_rows`.
        pool: where the host buffers come from.
    """
    spec = shard.spec
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


def stage(
    step: int,
    kind: Kind,
    shards: list[LocalShard],
    rows: list[torch.Tensor | None],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    pool: StagingPool,
) -> StagedCheckpoint:
    """Stages a checkpoint of ``kind`` at ``step``: each shard's ``rows``, the dense state
    and the serialized ``app_state``."""
    for kernel in {id(s.kernel): s.kernel for s in shards}.values():
        kernel.flush()  # caching kernels write their cache back first
    staged = [stage_shard(s, f"s{i}", r, pool) for i, (s, r) in enumerate(zip(shards, rows))]
    host_dense = {k: v.detach().to("cpu", copy=True) for k, v in dense.items()}
    if any(s.weight.device.type == "cuda" for s in shards):
        torch.cuda.synchronize()  # the non-blocking copies above must land before training resumes
    return StagedCheckpoint(step, kind, staged, host_dense, serialize_app_state(app_state))
