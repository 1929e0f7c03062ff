"""Eager staging: copy every row a checkpoint holds into host memory during ``save()``.

Check-N-Run (NSDI'22, Sec. 4.1) decouples checkpointing from training: the copy is the
only part of a save that stalls training. After :func:`stage` returns, training may
modify the model freely; the staged tensors are the checkpoint. Each shard goes to a
:class:`~torchrec_cnr.staging.shard.Sink` (the writer) as soon as it is staged.

``staging_memory_mb`` bounds the host memory a save holds. A checkpoint that fits is
staged whole and written in the background. One that does not is staged in chunks of
rows that fit: each chunk is written, and waited for, before the next is copied into the
same buffers, so the stall grows while memory does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchrec_cnr.selection.policy import Kind
from torchrec_cnr.snapshot.objects import serialize_app_state
from torchrec_cnr.staging.pool import StagingPool, chunk_rows, dense_buffer, staging_bytes
from torchrec_cnr.staging.shard import Sink, StagedCheckpoint, stage_shard
from torchrec_cnr.tracking.shard import LocalShard


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
    keys: list[str] | None = None,
) -> StagedCheckpoint:
    """Stages a checkpoint of ``kind`` at ``step`` into ``sink``: each shard's ``rows``
    (every row where ``None``) and which of them changed since the last checkpoint
    (``recent``, see :func:`~torchrec_cnr.selection.rows.select_recent`), then the dense
    state and the serialized ``app_state``. ``keys`` name the shards in the checkpoint
    (``s0``, ``s1``, ... if ``None``)."""
    names = keys if keys is not None else [f"s{i}" for i in range(len(shards))]
    changed = recent if recent is not None else [None] * len(shards)
    for kernel in {id(s.kernel): s.kernel for s in shards}.values():
        kernel.flush()  # caching kernels write their cache back first
    pool.begin()
    budget = pool.budget_bytes
    need = staging_bytes(shards, [None if r is None else r.numel() for r in rows])
    chunked = budget is not None and need > budget
    staged_bytes = 0
    for i, (shard, r) in enumerate(zip(shards, rows)):
        c = changed[i]
        tail = (
            r is not None
            and c is not None
            and c.numel() <= r.numel()
            and bool(torch.equal(r[r.numel() - c.numel() :], c))
        )
        if not chunked:
            staged = stage_shard(shard, names[i], r, pool, recent=c, tail=tail)
            staged_bytes += staged.nbytes
            sink.add(staged)
            continue
        total = shard.spec.rows if r is None else r.numel()
        step_rows = chunk_rows(shard, r is not None, budget) or total
        for row0 in range(0, max(total, 1), step_rows):
            block = slice(row0, min(row0 + step_rows, total))
            part: torch.Tensor | slice = block if r is None else r[block]
            first_chunk = c if row0 == 0 else None
            staged = stage_shard(shard, names[i], part, pool, "chunk", first_chunk, tail)
            staged_bytes += staged.nbytes
            sink.add(staged, row0, total)
            sink.wait()  # the next chunk reuses these buffers
    host_dense = {
        k: pool.take(dense_buffer(k), tuple(v.shape), v.dtype).copy_(v.detach())
        for k, v in dense.items()
    }
    return StagedCheckpoint(step, kind, host_dense, serialize_app_state(app_state), staged_bytes)
