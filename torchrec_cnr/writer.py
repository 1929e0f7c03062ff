"""Writing an encoded checkpoint through torchsnapshot, and reading it back.

Layout inside one checkpoint directory (one torchsnapshot snapshot):

- ``<rank>/rows/<name>``: a shard's stored tensors (see :mod:`torchrec_cnr.encoding`).
- ``dense/<name>``: replicated tensors, written once for all ranks (read as ``0/dense/<name>``).
- ``<rank>/app/blob``: the rank's ``app_state``, serialized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchsnapshot import Snapshot, StateDict

from torchrec_cnr import knobs
from torchrec_cnr.encoding import FormatResolver, encode_shard
from torchrec_cnr.integrity import CheckpointReadError, check, crc32, crc32_bytes
from torchrec_cnr.manifest import fsync_dir, fsync_tree
from torchrec_cnr.staging import StagedCheckpoint


class _NoInPlaceLoadWarning(logging.Filter):
    # read_object() of a non-tensor warns that it cannot load in place; we never ask it to.
    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support in-place load" not in record.getMessage()


logging.getLogger("torchsnapshot.snapshot").addFilter(_NoInPlaceLoadWarning())


@dataclass
class RankWrite:
    """What one rank reports after writing its part of a checkpoint."""

    shards: list[dict[str, Any]]
    dense_checksums: dict[str, int]
    app_checksum: int
    nbytes: int


def write_checkpoint(
    path: Path,
    staged: StagedCheckpoint,
    resolver: FormatResolver,
    pg: dist.ProcessGroup | None,
) -> RankWrite:
    """Encodes ``staged`` and collectively writes it to ``path``; makes this rank's part durable.

    Every rank of ``pg`` calls it. On return, the files this rank wrote are
    fsynced; the caller still has to agree across ranks before committing.
    """
    rows: dict[str, torch.Tensor] = {}
    records = []
    error: Exception | None = None
    try:
        for shard in staged.shards:
            spec = shard.shard.spec
            encoded = encode_shard(
                shard, resolver.resolve(spec.table, spec.num_embeddings), resolver.config
            )
            rows.update(encoded.tensors)
            records.append(encoded.record)
    except Exception as e:  # e.g. a NaN row: no rank may enter the collective write alone
        error = e
    failed = torch.tensor([int(error is not None)])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=pg)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("encoding failed on another rank")
    app_state = {
        "rows": StateDict(rows),
        "dense": StateDict(staged.dense),
        "app": StateDict(blob=staged.app_state),
    }
    Snapshot.take(str(path), app_state=app_state, pg=pg, replicated=["dense/**"])
    rank = dist.get_rank(pg)
    knobs.inject_fault(staged.step, rank)
    # torchsnapshot's fs plugin never fsyncs, and it packs small tensors of any
    # rank into shared "batched/" files, so each rank syncs the whole tree.
    # fsync of an already clean file costs next to nothing.
    fsync_tree(path)
    fsync_dir(path.parent)
    nbytes = sum(t.numel() * t.element_size() for t in rows.values()) + len(staged.app_state)
    return RankWrite(
        shards=records,
        dense_checksums={k: crc32(v) for k, v in staged.dense.items()},
        app_checksum=crc32_bytes(staged.app_state),
        nbytes=nbytes,
    )


class SnapshotReader:
    """Reads single tensors and objects out of one checkpoint directory.

    Args:
        path: the checkpoint directory.
        entry: its manifest entry; when given, every read is checked against
            the checksum recorded at save time.
    """

    def __init__(self, path: Path, entry: dict[str, Any] | None = None) -> None:
        if not (path / ".snapshot_metadata").exists():
            raise CheckpointReadError(f"checkpoint directory {path} is missing or incomplete")
        self.path = path
        self._snapshot = Snapshot(str(path))
        self._sums: dict[str, int] = {}
        if entry is not None:
            for rec in entry["shards"]:
                rank = rec["spec"]["rank"]
                for name, crc in rec["checksums"].items():
                    self._sums[f"{rank}/rows/{name}"] = crc
            for name, crc in entry["dense_checksums"].items():
                self._sums[f"0/dense/{name}"] = crc
            for rank, crc in enumerate(entry["app_checksums"]):
                self._sums[f"{rank}/app/blob"] = crc

    def rows_into(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Reads a stored tensor straight into ``out`` (same shape and dtype), e.g. a kernel's weights."""
        self._read(f"{rank}/rows/{name}", out)

    def _read(self, logical: str, out: torch.Tensor | None = None) -> Any:
        try:
            value: Any = self._snapshot.read_object(logical, obj_out=out)
        except Exception as e:  # torchsnapshot raises bare Exceptions and OSErrors
            raise CheckpointReadError(f"cannot read {logical!r} from {self.path}: {e}") from e
        if out is not None and value is not out:
            out.copy_(value)
            value = out
        check(value, self._sums.get(logical), f"{self.path.name}/{logical}")
        return value

    def rows(self, rank: int, name: str) -> torch.Tensor:
        value = self._read(f"{rank}/rows/{name}")
        assert isinstance(value, torch.Tensor), name
        return value

    def dense(self, name: str) -> torch.Tensor:
        value = self._read(f"0/dense/{name}")
        assert isinstance(value, torch.Tensor), name
        return value

    def app_state(self, rank: int) -> bytes:
        value = self._read(f"{rank}/app/blob")
        assert isinstance(value, bytes)
        return value
