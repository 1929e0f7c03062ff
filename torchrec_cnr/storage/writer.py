"""Writing one encoded checkpoint through torchsnapshot (Check-N-Run's writer).

Runs on the background writer thread of every rank, collectively over the writer's own
process group. Encoding (quantization, checksums) happens here, after the stall.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchsnapshot import Snapshot, StateDict

from torchrec_cnr import knobs
from torchrec_cnr.collectives import Collective
from torchrec_cnr.encoding import FormatResolver, ShardRecord, crc32, crc32_bytes, encode_shard
from torchrec_cnr.staging import StagedCheckpoint
from torchrec_cnr.storage.backend import Storage

__all__ = ["RankWrite", "write_checkpoint"]


@dataclass
class RankWrite:
    """What one rank reports after writing its part of a checkpoint."""

    shards: list[ShardRecord]
    dense_checksums: dict[str, int]
    app_checksum: int
    nbytes: int
    staged_bytes: int
    stall_s: float


def write_checkpoint(
    storage: Storage,
    ckpt_id: str,
    staged: StagedCheckpoint,
    resolver: FormatResolver,
    group: Collective,
) -> RankWrite:
    """Encodes ``staged`` and collectively writes it as ``ckpt_id``; makes this rank's part durable.

    Every rank of ``group`` calls it. On return, the files this rank wrote are fsynced;
    the caller still has to agree across ranks before committing.

    Raises:
        ValueError: a row holds NaN or Inf, on this or another rank (every rank raises
            before any enters torchsnapshot's collective write).
    """
    rows: dict[str, torch.Tensor] = {}
    records = []
    error: Exception | None = None
    try:
        for shard in staged.shards:
            spec = shard.shard.spec
            fmt = resolver.resolve(spec.table, spec.num_embeddings)
            encoded = encode_shard(shard, fmt, resolver.config)
            rows.update(encoded.tensors)
            records.append(encoded.record)
    except Exception as e:  # e.g. a NaN row: no rank may enter the collective write alone
        error = e
    group.agree(error)
    app_state = {
        "rows": StateDict(rows),
        "dense": StateDict(staged.dense),
        "app": StateDict(blob=staged.app_state),
    }
    Snapshot.take(storage.path(ckpt_id), app_state=app_state, pg=group.pg, replicated=["dense/**"])
    knobs.inject_fault(staged.step, group.rank)
    storage.make_durable(ckpt_id)
    nbytes = sum(t.numel() * t.element_size() for t in rows.values()) + len(staged.app_state)
    return RankWrite(
        shards=records,
        dense_checksums={k: crc32(v) for k, v in staged.dense.items()},
        app_checksum=crc32_bytes(staged.app_state),
        nbytes=nbytes,
        staged_bytes=staged.nbytes,
        stall_s=staged.stall_s,
    )
