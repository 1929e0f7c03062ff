"""Eager staging: copy every row a checkpoint holds into host memory during ``save()``.

Check-N-Run (NSDI'22, Sec. 4.1) decouples checkpointing from training: the copy is the
only part of a save that stalls training. After :func:`stage` returns, training may
modify the model freely; the staged tensors are the checkpoint. Each shard goes to a
:class:`~torchrec_cnr.staging.shard.Sink` (the writer) as soon as it is staged.

A shard the plan stages ``eager`` is copied whole into its buffers and written in the
background. One it stages ``chunked`` (the checkpoint does not fit ``staging_memory_mb``,
see :mod:`.plan`) is copied in chunks of rows that fit: each chunk is written, and waited
for, before the next is copied into the same buffers, so the stall grows while memory
does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrec_cnr.snapshot.objects import serialize_app_state
from torchrec_cnr.staging.plan import SavePlan, ShardPlan
from torchrec_cnr.staging.pool import StagingPool, chunk_rows, dense_buffer
from torchrec_cnr.staging.shard import Sink, StagedCheckpoint, stage_shard
from torchrec_cnr.tracking.shard import LocalShard


def stage(
    plan: SavePlan,
    dense: Mapping[str, Any],
    app_state: Mapping[str, Any],
    pool: StagingPool,
    sink: Sink,
) -> StagedCheckpoint:
    """Stages the shards ``plan`` copies during ``save()`` into ``sink``, then copies the
    dense state and serializes ``app_state``. The shards it stages lazily are left to
    :class:`~torchrec_cnr.staging.lazy.LazyStaging`."""
    eager = plan.staged("eager", "chunked")
    for kernel in {id(p.shard.kernel): p.shard.kernel for p in eager}.values():
        kernel.flush()  # caching kernels write their cache back first
    pool.begin()
    staged_bytes = sum(_stage(p, pool, sink) for p in eager)
    host_dense = {
        k: pool.take(dense_buffer(k), tuple(v.shape), v.dtype).copy_(v.detach())
        for k, v in dense.items()
    }
    return StagedCheckpoint(
        plan.step, plan.decision.kind, host_dense, serialize_app_state(app_state), staged_bytes
    )


def _stage(p: ShardPlan, pool: StagingPool, sink: Sink) -> int:
    """Stages one shard as planned; returns the bytes staged (chunks count once each)."""
    shard: LocalShard = p.shard
    if p.strategy == "eager":
        staged = stage_shard(shard, p.key, p.rows, pool, recent=p.recent, tail=p.tail)
        sink.add(staged)
        return staged.nbytes
    r, tail, nbytes = p.rows, p.tail, 0
    total = shard.spec.rows if r is None else r.numel()
    step_rows = chunk_rows(shard, r is not None, pool.budget_bytes) or total
    for row0 in range(0, max(total, 1), step_rows):
        block = slice(row0, min(row0 + step_rows, total))
        part = block if r is None else r[block]
        first_chunk = p.recent if row0 == 0 else None
        staged = stage_shard(shard, p.key, part, pool, "chunk", first_chunk, tail)
        nbytes += staged.nbytes
        sink.add(staged, row0, total)
        sink.wait()  # the next chunk reuses these buffers
    return nbytes
