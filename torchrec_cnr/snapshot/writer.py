"""One writer's part of a checkpoint directory, written in parallel, in torchsnapshot's format.

Check-N-Run writes checkpoints as torchsnapshot snapshots, and so does this module: the
directory's ``.snapshot_metadata`` is torchsnapshot's index, built from its own typed
entries (``torchsnapshot.manifest``), and torchsnapshot's reader reads the tensors back
(``tests/unit/test_snapshot.py`` checks it). The writing is ours: torchsnapshot 0.1.0
took 3-4 s to write and sync one rank's 1 GB where the disk needs 0.5 s. Here:

- a tensor is cut into objects of at most ``object_bytes`` (whole rows), each written on
  the caller's I/O executor, with the CRC32 of its bytes computed on the thread that
  writes it;
- tensors far smaller than that are packed into shared objects;
- a tensor may arrive in several row chunks (a shard staged in chunks to bound memory);
  its CRC32 combines those of its pieces, in row order.

A directory is complete only once :func:`write_index` wrote the index, after every
writer's part is durable; until a committed manifest names it, it does not exist for a
restore.
"""

from __future__ import annotations

import math
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from torchrec_cnr.schema import SNAPSHOT_MARKER
from torchrec_cnr.snapshot.checksum import as_bytes, crc32_bytes, crc32_combine
from torchrec_cnr.snapshot.index import (
    ChunkedTensorEntry,
    IndexEntry,
    IndexPart,
    IndexShard,
    PrimitiveEntry,
    TensorEntry,
    index_bytes,
    index_dtype_name,
    index_part,
)
from torchrec_cnr.storage import Storage

__all__ = ["RankPart", "SnapshotWriter", "write_index"]

"""The torchsnapshot format version the index declares."""


BLOCK_BYTES = 8 << 20
"""A stored tensor's rows are checksummed in blocks of about this many bytes (whole rows,
each object's from its first row): a restore that needs some rows reads and checks only
their blocks (:attr:`~torchrec_cnr.schema.ShardRecord.block_checksums`)."""


def _block_sums(data: memoryview, block_bytes: int) -> list[int]:
    """The CRC32 of each ``block_bytes`` of ``data`` (the last one shorter)."""
    return [crc32_bytes(data[at : at + block_bytes]) for at in range(0, len(data), block_bytes)]


def _put(storage: Storage, name: str, data: memoryview, block_bytes: int) -> list[int]:
    sums = _block_sums(data, block_bytes)
    storage.write_object(name, data)
    return sums


@dataclass
class _Piece:
    row0: int
    rows: int
    location: str
    start: int
    nbytes: int
    crcs: Future[list[int]] | list[int]
    """The CRC32 of each of its blocks of ``block_bytes``."""
    block_bytes: int

    def blocks(self) -> list[int]:
        return self.crcs if isinstance(self.crcs, list) else self.crcs.result()

    def checksum(self) -> int:
        crc, blocks = 0, self.blocks()
        for k, block in enumerate(blocks):
            last = k == len(blocks) - 1
            length = self.nbytes - k * self.block_bytes if last else self.block_bytes
            crc = crc32_combine(crc, block, length)
        return crc


@dataclass
class _Logical:
    dtype: torch.dtype
    row_shape: list[int]
    rows: int
    replicated: bool
    shape: list[int]
    """As first written; ``[]`` for a 0-d tensor, which is written as one row."""
    pieces: list[_Piece] = field(default_factory=list)


@dataclass
class RankPart:
    """What one rank wrote into a checkpoint directory."""

    index: IndexPart
    """Its torchsnapshot index entries, serialized (:func:`write_index` joins them)."""
    checksums: dict[str, int]
    """Logical path -> CRC32 of the whole tensor (or bytes)."""
    nbytes: int
    blocks: dict[str, list[int]] = field(default_factory=dict)
    """Logical path -> CRC32 of each stored block of rows, in row order, for a tensor
    stored in more than one: a reader of some rows reads and checks only their blocks."""


class SnapshotWriter:
    """Writes tensors into one checkpoint directory, as one writer (a rank) of it.

    Args:
        storage: the root.
        ckpt_id: the checkpoint directory.
        prefix: names this writer's data objects apart from other writers'.
        executor: runs the object writes; the caller owns it.
        object_bytes: the largest data object (``IOOptions.object_bytes``).
    """

    def __init__(
        self, storage: Storage, ckpt_id: str, prefix: str, executor: Executor, object_bytes: int
    ) -> None:
        self.storage = storage
        self.ckpt_id = ckpt_id
        self.prefix = prefix
        self.executor = executor
        self.object_bytes = object_bytes
        # Smaller tensors are packed into shared objects (copied: at most this much each).
        self.small_bytes = min(1 << 20, self.object_bytes // 8)
        self._objects = 0
        self._futures: list[Future[list[int]]] = []
        self._tensors: dict[str, _Logical] = {}
        self._inline: dict[str, bytes] = {}
        self._batch: list[tuple[_Piece, bytes]] = []
        self._batch_bytes = 0

    def _location(self) -> str:
        self._objects += 1
        return f"data/{self.prefix}-{self._objects - 1}"

    def _submit(self, location: str, data: memoryview, block_bytes: int) -> Future[list[int]]:
        name = f"{self.ckpt_id}/{location}"
        future = self.executor.submit(_put, self.storage, name, data, block_bytes)
        self._futures.append(future)
        return future

    def write(
        self,
        logical: str,
        tensor: torch.Tensor,
        row0: int = 0,
        total_rows: int | None = None,
        replicated: bool = False,
    ) -> None:
        """Writes ``tensor`` as rows ``row0..`` of the logical tensor ``logical``.

        A tensor written whole needs no ``row0`` or ``total_rows``. One written in row
        chunks is given them with each chunk; the chunks must cover its rows exactly.
        The tensor must stay unchanged until :meth:`wait` or :meth:`finish` returns.
        """
        t = tensor.detach()
        if t.device.type != "cpu":
            raise ValueError(f"{logical}: a CPU tensor is needed")
        shape = list(t.shape)
        t = t.contiguous().reshape(-1) if t.dim() == 0 else t.contiguous()
        rows = t.shape[0]
        total = rows if total_rows is None else total_rows
        known = self._tensors.setdefault(
            logical, _Logical(t.dtype, list(t.shape[1:]), total, replicated, shape)
        )
        if (known.dtype, known.row_shape, known.rows) != (t.dtype, list(t.shape[1:]), total):
            raise ValueError(f"{logical}: a chunk of another dtype or shape")
        data = as_bytes(t)
        if len(data) < self.small_bytes:
            crcs = [crc32_bytes(data)]
            piece = _Piece(row0, rows, "", self._batch_bytes, len(data), crcs, len(data))
            self._batch.append((piece, bytes(data)))
            self._batch_bytes += len(data)
            known.pieces.append(piece)
            if self._batch_bytes >= self.object_bytes // 2:
                self._flush_batch()
            return
        row_bytes = _row_bytes(known)
        step = max(1, self.object_bytes // row_bytes)
        block = self._block_rows(row_bytes) * row_bytes
        for first in range(0, rows, step):
            n = min(step, rows - first)
            location = self._location()
            view = data[first * row_bytes : (first + n) * row_bytes]
            future = self._submit(location, view, block)
            known.pieces.append(_Piece(row0 + first, n, location, 0, len(view), future, block))

    def _block_rows(self, row_bytes: int) -> int:
        """Rows per checksummed block of a tensor's objects (see :data:`BLOCK_BYTES`)."""
        return max(1, min(self.object_bytes, BLOCK_BYTES) // row_bytes)

    def add_bytes(self, logical: str, value: bytes) -> None:
        """Stores ``value`` inline in the index, as torchsnapshot stores ``bytes``."""
        self._inline[logical] = value

    def _flush_batch(self) -> None:
        if not self._batch:
            return
        location = self._location()
        for piece, _ in self._batch:
            piece.location = location
        data = memoryview(b"".join(data for _, data in self._batch))
        self._submit(location, data, max(1, len(data)))
        self._batch, self._batch_bytes = [], 0

    def wait(self) -> None:
        """Blocks until everything written so far is durable (so its buffers may be reused),
        or has failed: no write is left running, whichever failed first.

        Raises:
            OSError: a write failed (the first error).
        """
        self._flush_batch()
        futures.wait(self._futures)
        for future in self._futures:
            future.result()

    def finish(self) -> RankPart:
        """Waits for every write; returns the index entries and checksums of this writer."""
        self._flush_batch()
        self.wait()
        entries: dict[str, IndexEntry] = {}
        checksums: dict[str, int] = {}
        blocks: dict[str, list[int]] = {}
        nbytes = 0
        for logical, t in self._tensors.items():
            pieces = sorted(t.pieces, key=lambda p: p.row0)
            covered = 0
            crc = 0
            for piece in pieces:
                if piece.row0 != covered:
                    raise ValueError(f"{logical}: rows {covered}..{piece.row0} were never written")
                covered += piece.rows
                crc = crc32_combine(crc, piece.checksum(), piece.nbytes)
            if covered != t.rows:
                raise ValueError(f"{logical}: {covered} of {t.rows} rows written")
            entries[logical] = _entry(t, pieces)
            checksums[logical] = crc
            sums = [crc for piece in pieces for crc in piece.blocks()]
            if len(sums) > 1:
                blocks[logical] = [self._block_rows(_row_bytes(t)), *sums]
            nbytes += sum(p.nbytes for p in pieces)
        for logical, value in self._inline.items():
            entries[logical] = PrimitiveEntry.of_bytes(value)
            checksums[logical] = crc32_bytes(value)
            nbytes += len(value)
        return RankPart(index_part(entries), checksums, nbytes, blocks)


def _row_bytes(t: _Logical) -> int:
    return max(1, math.prod(t.row_shape) * t.dtype.itemsize)


def _tensor_entry(t: _Logical, piece: _Piece, shape: list[int]) -> TensorEntry:
    return TensorEntry(
        location=piece.location,
        serializer="buffer_protocol",
        dtype=index_dtype_name(t.dtype),
        shape=shape,
        replicated=t.replicated,
        byte_range=[piece.start, piece.start + piece.nbytes],
    )


def _entry(t: _Logical, pieces: list[_Piece]) -> IndexEntry:
    if len(pieces) == 1:
        return _tensor_entry(t, pieces[0], [t.rows, *t.row_shape] if t.shape else [])
    chunks = [
        IndexShard(
            offsets=[p.row0] + [0] * len(t.row_shape),
            sizes=[p.rows, *t.row_shape],
            tensor=_tensor_entry(t, p, [p.rows, *t.row_shape]),
        )
        for p in pieces
    ]
    return ChunkedTensorEntry(
        index_dtype_name(t.dtype), [t.rows, *t.row_shape], chunks, t.replicated
    )


def write_index(storage: Storage, ckpt_id: str, parts: list[IndexPart], world_size: int) -> None:
    """Writes the index of a checkpoint directory from its writers' entries.

    IMPORTANT: call it last, once every writer's part is durable: the directory reads as
    complete only then.
    """
    storage.write(f"{ckpt_id}/{SNAPSHOT_MARKER}", index_bytes(parts, world_size))
