"""Reading single tensors and objects out of one checkpoint, without a model.

Checkpoints are torchsnapshot snapshots; this reads them without torchsnapshot's read
path: its ``.snapshot_metadata`` (one JSON document, read once) says where each tensor's
bytes lie, and the bytes are read straight into the tensor through the root's
:class:`~torchrec_cnr.storage.Storage` (a ranged GET on an object store). That costs one
request per tensor instead of torchsnapshot's new event loop, storage client and manifest
walk per read, and lets :meth:`SnapshotReader.read_many` read in parallel.

Every read can be checked against the checksum recorded at save time.
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torchsnapshot.serialization import string_to_dtype, torch_load_from_bytes

from torchrec_cnr import knobs
from torchrec_cnr.encoding import check
from torchrec_cnr.errors import CheckpointReadError
from torchrec_cnr.storage.backend import Storage
from torchrec_cnr.storage.layout import SNAPSHOT_MARKER, app_path, dense_path, rows_path

__all__ = ["SnapshotReader"]


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor, whatever its dtype (bf16 included)."""
    array: Any = t.view(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class SnapshotReader:
    """Reads single tensors and objects out of one checkpoint.

    Args:
        storage: the checkpoint root.
        ckpt_id: the checkpoint's directory.
        checksums: logical path (see :mod:`torchrec_cnr.storage.layout`) -> CRC32;
            every read of a listed path is checked.

    Raises:
        CheckpointReadError: the directory is missing, was never completed, or its
            metadata is damaged.
    """

    def __init__(
        self, storage: Storage, ckpt_id: str, checksums: dict[str, int] | None = None
    ) -> None:
        self.storage = storage
        self.name = ckpt_id
        self.path = storage.path(ckpt_id)
        got = storage.read(f"{ckpt_id}/{SNAPSHOT_MARKER}")
        if got is None:
            raise CheckpointReadError(f"checkpoint directory {self.path} is missing or incomplete")
        try:
            self._entries: dict[str, Any] = json.loads(got[0])["manifest"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointReadError(f"{self.path}/{SNAPSHOT_MARKER} is damaged: {e}") from e
        self._sums = checksums or {}

    def _tensor(self, entry: dict[str, Any], out: torch.Tensor | None) -> torch.Tensor:
        dtype = string_to_dtype(entry["dtype"])
        shape = list(entry["shape"])
        location = f"{self.name}/{entry['location']}"
        start, end = entry.get("byte_range") or (0, None)
        if entry["serializer"] != "buffer_protocol":
            size = end - start if end is not None else None
            if size is None:
                data = self.storage.read(location)
                blob = b"" if data is None else data[0]
            else:
                buf = bytearray(size)
                self.storage.read_into(location, start, memoryview(buf))
                blob = bytes(buf)
            value = torch_load_from_bytes(blob)
            if out is None:
                return value
            out.copy_(value)
            return out
        target = out if out is not None and out.is_contiguous() else torch.empty(shape, dtype=dtype)
        if list(target.shape) != shape or target.dtype != dtype:
            raise CheckpointReadError(
                f"{location}: stored {dtype} {shape}, wanted {target.dtype} {list(target.shape)}"
            )
        self.storage.read_into(location, start, _as_bytes(target))
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def _read(self, logical: str, out: torch.Tensor | None = None) -> Any:
        entry = self._entries.get(logical)
        if entry is None:
            raise CheckpointReadError(f"{self.path} holds no {logical!r}")
        try:
            kind = entry["type"]
            if kind == "Tensor":
                value: Any = self._tensor(entry, out)
            elif kind == "ChunkedTensor":
                dtype = string_to_dtype(entry["dtype"])
                value = out if out is not None else torch.empty(entry["shape"], dtype=dtype)
                for chunk in entry["chunks"]:
                    view = value
                    for dim, (offset, size) in enumerate(zip(chunk["offsets"], chunk["sizes"])):
                        view = view.narrow(dim, offset, size)
                    self._tensor(chunk["tensor"], view)
            elif kind == "bytes":
                value = base64.b64decode(entry["serialized_value"])
            else:
                raise CheckpointReadError(f"{self.path}: {logical!r} is a {kind}, not a tensor")
        except CheckpointReadError:
            raise
        except Exception as e:  # a missing or short file, a broken connection, ...
            raise CheckpointReadError(f"cannot read {logical!r} from {self.path}: {e}") from e
        check(value, self._sums.get(logical), f"{self.name}/{logical}")
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

    def rows_subset(self, rank: int, name: str, index: torch.Tensor) -> torch.Tensor:
        """Only the rows ``index`` (ascending) of a stored shard tensor, read alone.

        Reads each run of consecutive rows with one request and nothing else, so no
        checksum can be checked (it covers the whole tensor).
        """
        logical = rows_path(rank, name)
        entry = self._entries.get(logical)
        if entry is None or entry["type"] != "Tensor" or entry["serializer"] != "buffer_protocol":
            return self.rows(rank, name)[index]  # chunked or pickled: read it whole
        dtype = string_to_dtype(entry["dtype"])
        shape = list(entry["shape"])
        out = torch.empty([index.numel(), *shape[1:]], dtype=dtype)
        if not index.numel():
            return out
        row_bytes = out[0].numel() * out.element_size()
        start = (entry.get("byte_range") or (0, None))[0]
        location = f"{self.name}/{entry['location']}"
        # Runs of consecutive rows: one read each.
        breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1
        bounds = [0, *breaks.tolist(), index.numel()]
        target = _as_bytes(out)
        try:
            for a, b in zip(bounds, bounds[1:]):
                first = int(index[a])
                self.storage.read_into(
                    location, start + first * row_bytes, target[a * row_bytes : b * row_bytes]
                )
        except Exception as e:
            raise CheckpointReadError(f"cannot read {logical!r} from {self.path}: {e}") from e
        return out

    def read_many(self, wanted: list[tuple[int, str]]) -> dict[tuple[int, str], torch.Tensor]:
        """Reads many shard tensors ``(rank, name)`` at once, on ``TORCHREC_CNR_IO_THREADS`` threads."""
        if not wanted:
            return {}
        with ThreadPoolExecutor(min(knobs.io_threads(), len(wanted))) as pool:
            values = list(pool.map(lambda key: self.rows(*key), wanted))
        return dict(zip(wanted, values))
