"""Writing a staged checkpoint through torchsnapshot.

Layout inside one checkpoint directory (one torchsnapshot snapshot):

- ``<rank>/rows/<key>.w``: ``(n, cols)`` row values of a shard.
- ``<rank>/rows/<key>.ids``: ``(n,)`` global row ids (absent when all rows are stored).
- ``<rank>/rows/<key>.<state>``: per-row optimizer state of those rows.
- ``dense/<name>``: replicated tensors, written once for all ranks (read as ``0/dense/<name>``).
- ``<rank>/app/blob``: the rank's ``app_state``, serialized.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torchsnapshot import Snapshot, StateDict

from torchrec_cnr.manifest import fsync_dir, fsync_tree
from torchrec_cnr.staging import StagedCheckpoint


class _NoInPlaceLoadWarning(logging.Filter):
    # read_object() of a non-tensor warns that it cannot load in place; we never ask it to.
    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support in-place load" not in record.getMessage()


logging.getLogger("torchsnapshot.snapshot").addFilter(_NoInPlaceLoadWarning())


class CheckpointReadError(RuntimeError):
    """A committed checkpoint's files are missing or unreadable."""


def write_snapshot(path: Path, staged: StagedCheckpoint, pg: dist.ProcessGroup | None) -> None:
    """Collectively writes ``staged`` to ``path`` and makes this rank's part durable.

    Every rank calls it. On return, the files this rank can see under ``path``
    are fsynced; the caller still has to agree across ranks before committing.
    """
    rows: dict[str, torch.Tensor] = {}
    for shard in staged.shards:
        rows.update(shard.tensors())
    app_state = {
        "rows": StateDict(rows),
        "dense": StateDict(staged.dense),
        "app": StateDict(blob=staged.app_state),
    }
    Snapshot.take(str(path), app_state=app_state, pg=pg, replicated=["dense/**"])
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    # torchsnapshot's fs plugin never fsyncs. Each rank syncs what it wrote:
    # its own folder and its part of the replicated folder.
    for sub in (str(rank), "replicated"):
        if (path / sub).exists():
            fsync_tree(path / sub)
    if rank == 0:
        metadata = path / ".snapshot_metadata"
        if metadata.exists():
            fd = os.open(metadata, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(path)
        fsync_dir(path.parent)


class SnapshotReader:
    """Reads single tensors and objects out of one checkpoint directory."""

    def __init__(self, path: Path) -> None:
        if not (path / ".snapshot_metadata").exists():
            raise CheckpointReadError(f"checkpoint directory {path} is missing or incomplete")
        self.path = path
        self._snapshot = Snapshot(str(path))

    def _read(self, logical: str) -> object:
        try:
            return self._snapshot.read_object(logical)
        except Exception as e:  # torchsnapshot raises bare Exceptions and OSErrors
            raise CheckpointReadError(f"cannot read {logical!r} from {self.path}: {e}") from e

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
