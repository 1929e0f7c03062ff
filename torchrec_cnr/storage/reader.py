"""Reading single tensors and objects out of one checkpoint, without a model.

Every read can be checked against the checksum recorded at save time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torchsnapshot import Snapshot

from torchrec_cnr.encoding import check
from torchrec_cnr.errors import CheckpointReadError
from torchrec_cnr.storage.layout import app_path, dense_path, rows_path

__all__ = ["SnapshotReader"]


class _NoInPlaceLoadWarning(logging.Filter):
    # read_object() of a non-tensor warns that it cannot load in place; we never ask it to.
    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support in-place load" not in record.getMessage()


logging.getLogger("torchsnapshot.snapshot").addFilter(_NoInPlaceLoadWarning())


class SnapshotReader:
    """Reads single tensors and objects out of one checkpoint directory.

    Args:
        path: the checkpoint directory.
        checksums: logical path (see :mod:`torchrec_cnr.storage.layout`) -> CRC32;
            every read of a listed path is checked.

    Raises:
        CheckpointReadError: the directory is missing or was never completed.
    """

    def __init__(self, path: Path, checksums: dict[str, int] | None = None) -> None:
        if not (path / ".snapshot_metadata").exists():
            raise CheckpointReadError(f"checkpoint directory {path} is missing or incomplete")
        self.path = path
        self._snapshot = Snapshot(str(path))
        self._sums = checksums or {}

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
        """A stored shard tensor of ``rank``."""
        value = self._read(rows_path(rank, name))
        assert isinstance(value, torch.Tensor), name
        return value

    def rows_into(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Reads a stored tensor straight into ``out`` (same shape and dtype), e.g. a kernel's weights."""
        self._read(rows_path(rank, name), out)

    def dense(self, name: str) -> torch.Tensor:
        value = self._read(dense_path(name))
        assert isinstance(value, torch.Tensor), name
        return value

    def app_state(self, rank: int) -> bytes:
        value = self._read(app_path(rank))
        assert isinstance(value, bytes)
        return value
