"""Writing one encoded checkpoint through torchsnapshot (Check-N-Run's writer).

Runs on the background writer thread of every rank, collectively over the writer's own
process group. Encoding (quantization, checksums) happens here, after the stall.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torchsnapshot import Snapshot, StateDict
from torchsnapshot.serialization import dtype_to_string

from torchrec_cnr import knobs
from torchrec_cnr.collectives import Collective
from torchrec_cnr.encoding import FormatResolver, ShardRecord, crc32, crc32_bytes, encode_shard
from torchrec_cnr.staging import StagedCheckpoint
from torchrec_cnr.storage.backend import Storage
from torchrec_cnr.storage.layout import SNAPSHOT_MARKER

__all__ = ["RankWrite", "SnapshotParts", "write_checkpoint", "write_snapshot_metadata"]


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


@dataclass
class SnapshotParts:
    """Tensors and objects written into one checkpoint directory in torchsnapshot's format,
    without torchsnapshot: for checkpoints that do not come from a live model (compaction).

    Each :meth:`add` writes one data object; :func:`write_snapshot_metadata` writes the
    index last, as torchsnapshot does, so that the directory reads as complete only then.
    """

    storage: Storage
    ckpt_id: str
    prefix: str
    """Names this writer's data objects apart from other writers' of the same checkpoint."""
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    _objects: int = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Writes ``tensors`` (logical path -> tensor) as one data object."""
        location = f"data/{self.prefix}-{self._objects}"
        self._objects += 1
        chunks, offset = [], 0
        for logical, tensor in tensors.items():
            t = tensor.detach().contiguous().cpu()
            data = t.view(-1).view(torch.uint8).numpy().tobytes()
            self.entries[logical] = {
                "type": "Tensor",
                "location": location,
                "serializer": "buffer_protocol",
                "dtype": dtype_to_string(t.dtype),
                "shape": list(t.shape),
                "replicated": logical.startswith("0/dense/"),
                "byte_range": [offset, offset + len(data)],
            }
            chunks.append(data)
            offset += len(data)
        self.storage.write(f"{self.ckpt_id}/{location}", b"".join(chunks))

    def add_bytes(self, logical: str, value: bytes) -> None:
        """Stores ``value`` inline in the index, as torchsnapshot stores ``bytes``."""
        self.entries[logical] = {
            "type": "bytes",
            "serialized_value": base64.b64encode(value).decode(),
            "replicated": False,
            "readable": None,
        }


def write_snapshot_metadata(
    storage: Storage, ckpt_id: str, entries: dict[str, dict[str, Any]], world_size: int
) -> None:
    """Writes the index of a checkpoint assembled by :class:`SnapshotParts`; call it last,
    once every data object is durable."""
    manifest: dict[str, Any] = {}
    for logical in sorted(entries):
        parent, _, key = logical.rpartition("/")
        manifest.setdefault(parent, {"type": "dict", "keys": []})["keys"].append(key)
    manifest.update(entries)
    document = {"version": "0.1.0", "world_size": world_size, "manifest": manifest}
    storage.write(f"{ckpt_id}/{SNAPSHOT_MARKER}", json.dumps(document, indent=1).encode())
