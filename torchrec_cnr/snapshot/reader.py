"""Reading tensors and objects out of one checkpoint, without a model.

Checkpoints are torchsnapshot snapshots; this reads them without torchsnapshot's read
path: its ``.snapshot_metadata`` (one JSON document, read once, parsed into
torchsnapshot's typed entries) says where each tensor's bytes lie, and the bytes are read
straight into the tensor through the root's :class:`~torchrec_cnr.storage.Storage` (a
ranged GET on an object store). Every tensor is read in pieces of at most
``piece_bytes`` on the caller's I/O executor, many tensors at once; each piece's CRC32 is
computed on the thread that read it, and the pieces' CRCs are combined into the tensor's
and checked against the one recorded at save time.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from torchrec_cnr.errors import CheckpointReadError, brief
from torchrec_cnr.schema import SNAPSHOT_MARKER, app_path, dense_path, rows_path
from torchrec_cnr.snapshot.buffers import HUGE_PAGE, Buffers, anonymous
from torchrec_cnr.snapshot.checksum import (
    as_bytes,
    check,
    crc32,
    crc32_bytes,
    crc32_combine,
    mismatch,
)
from torchrec_cnr.snapshot.index import (
    ChunkedTensorEntry,
    IndexEntry,
    PrimitiveEntry,
    TensorEntry,
    named_dtype,
    parse_index,
)
from torchrec_cnr.snapshot.objects import load_object
from torchrec_cnr.storage import DIRECT_ALIGN, DIRECT_MIN_BYTES, Storage

__all__ = ["SnapshotReader", "page_aligned", "settle"]

Alloc = Callable[[list[int], torch.dtype], "torch.Tensor | None"]
"""Gives the tensor of ``shape`` and ``dtype`` to read into, or ``None`` for a fresh one."""


def page_aligned(numel: int, dtype: torch.dtype, pin: bool = False, phase: int = 0) -> torch.Tensor:
    """An uninitialized 1-d tensor whose data starts on a 4 KiB boundary: objects go
    between it and the disk with ``O_DIRECT``, without a bounce copy. ``pin``:
    page-locked (for asynchronous copies from CUDA). ``phase``: starts that many bytes
    (mod 4 KiB) past one instead, as the bytes read into it lie in their file, which
    ``O_DIRECT`` then reads straight in past their first block. A huge page or more
    unpinned is memory of its own, advised for huge pages (:func:`anonymous`)."""
    nbytes = numel * dtype.itemsize
    if not pin and nbytes >= HUGE_PAGE:
        skip = phase % DIRECT_ALIGN
        raw = torch.frombuffer(anonymous(skip + nbytes), dtype=torch.uint8, count=skip + nbytes)
        return raw[skip:].view(dtype)
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (phase - raw.data_ptr()) % DIRECT_ALIGN
    return raw[skip : skip + nbytes].view(dtype)


T = TypeVar("T")


def settle(reads: list[Callable[[], T]]) -> list[T]:
    """What each of ``reads`` gives, every one waited for even after one fails (so that
    none is still reading when this returns); the first failure is raised."""
    out, failed = [], None
    for read in reads:
        try:
            out.append(read())
        except Exception as e:
            failed = failed or e
    if failed is not None:
        raise failed
    return out


@contextlib.contextmanager
def ending_first(begun: Sequence[Callable[[], object]]) -> Iterator[None]:
    """Where the block raises, waits for each of ``begun`` (the waits of the reads it
    began so far, their failures dropped) before the failure goes on: no read it began
    still writes into its target after."""
    try:
        yield
    except Exception:
        with contextlib.suppress(Exception):
            settle(list(begun))
        raise


def _failed(e: Exception) -> Future[None]:
    """A future that failed with ``e``."""
    future: Future[None] = Future()
    future.set_exception(e)
    return future


def _empty(shape: list[int], dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
    """A tensor to read into: page-aligned (or at ``phase``: see :func:`page_aligned`)
    where it is large enough to be read directly."""
    numel = math.prod(shape)
    if numel * dtype.itemsize < DIRECT_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return page_aligned(numel, dtype, phase=phase).view(shape)


def _get(
    storage: Storage, location: str, start: int, out: memoryview, crc: bool, cached: bool = False
) -> int:
    storage.read_into(location, start, out, cached)
    return crc32_bytes(out) if crc else 0


SMALL_BYTES = 64 << 10
"""A piece at most this large is not read on its own: the small pieces of one object that
one call begins, each within a request's worth of bytes (:attr:`Storage.request_bytes`)
of the next, are read with one request into a scratch buffer and copied out (a restore of
small tables made a request per tensor: in the tests' S3 resumes, 774 GETs where 318 do)."""


class _Deferred(Future[int]):
    """A small piece's CRC32 (see :data:`SMALL_BYTES`), read once its reader flushes the
    pieces queued beside it, which any wait for it does first."""

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__()
        self._flush = flush

    def result(self, timeout: float | None = None) -> int:
        self._flush()
        return super().result(timeout)


@dataclass(frozen=True)
class _Small:
    """A small piece queued: ``out`` holds the bytes of ``location`` from ``start`` on."""

    location: str
    start: int
    out: memoryview
    crc: bool
    cached: bool
    future: _Deferred

    @property
    def end(self) -> int:
        return self.start + len(self.out)


def _get_together(storage: Storage, pieces: list[_Small]) -> None:
    """Reads ``pieces`` (of one object, by ``start``) with one request; each piece's
    future gets its CRC32, or the error."""
    try:
        first = pieces[0]
        if len(pieces) == 1:
            storage.read_into(first.location, first.start, first.out, first.cached)
        else:
            span = memoryview(bytearray(max(p.end for p in pieces) - first.start))
            storage.read_into(first.location, first.start, span, first.cached)
            for p in pieces:
                p.out[:] = span[p.start - first.start : p.end - first.start]
        for p in pieces:
            p.future.set_result(crc32_bytes(p.out) if p.crc else 0)
    except BaseException as e:
        for p in pieces:
            if not p.future.done():
                p.future.set_exception(e)


def _row_offset(tensor: TensorEntry, row: int, row_bytes: int) -> int:
    """Where stored row ``row`` of ``tensor`` (rows of ``row_bytes``) starts in its object."""
    return (tensor.byte_range or (0, 0))[0] + row * row_bytes


@dataclass
class _Read:
    """One tensor being read: its pieces, in the order of its bytes."""

    logical: str
    value: torch.Tensor
    pieces: list[tuple[Future[int], int]] = field(default_factory=list)
    """(CRC32 of the piece, its length)."""
    whole: bool = False
    """The pieces do not cover the bytes in order (a pickled tensor, or one chunked along
    another dim): the checksum is computed over the whole tensor once read."""


SPAN_BYTES = 8 << 20
"""Bytes of a merged span (rows read with the gaps between them) read at once, into a
buffer each reading thread keeps, the wanted rows then taken out of it: a span read whole
into a fresh buffer paid a page fault per 4 KiB and a pass over memory that no longer
held it (a cold start reads most of a baseline's rows this way)."""


def span_bytes(storage: Storage) -> int:
    """Bytes of a merged span read with one request: :data:`SPAN_BYTES`, or on a store
    whose request costs more (:attr:`Storage.request_bytes`), sixteen requests' worth, so
    that a request's own cost stays about a sixteenth of its read's (32 MB a GET on S3)."""
    return max(SPAN_BYTES, 16 * storage.request_bytes)


_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's reusable buffer of at least ``nbytes`` bytes."""
    buf: torch.Tensor | None = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(max(nbytes, SPAN_BYTES), dtype=torch.uint8)
    return buf[:nbytes]


COALESCE_EXTRA = 1.0
"""How many more rows than wanted a read of some rows may fetch to merge nearby runs: at
most twice the wanted bytes. A request costs far more than the rows of a small gap (about
0.1 ms here, the time to read 100-200 KB): a follower many checkpoints behind reads the
scattered survivors of each delta in about 200 requests per GB, not one per run
(measured on a 1 GB consecutive chain 13 checkpoints behind: 2.9 s and 5k requests
against 22 s and 130k at 0.15)."""


def _spans(
    index: torch.Tensor,
    segment: torch.Tensor,
    extra: float,
    merge_rows: int = 0,
    many: int = Storage.many_requests,
) -> list[tuple[int, int]]:
    """``[a, b)`` positions of ``index`` (ascending distinct rows) read with one request each:
    runs of consecutive rows of one stored object, the runs whose gaps are smallest
    merged while the rows skipped over stay within ``extra`` times ``len(index)``; and
    where that leaves more than ``many``, runs at most ``merge_rows`` apart
    merged too (reading the gap costs less than a request: rows scattered through a whole
    table, such as a baseline's changed rows, are read in large pieces)."""
    n = index.numel()
    if n and int(index[-1]) - int(index[0]) == n - 1 and int(segment[0]) == int(segment[-1]):
        return [(0, n)]  # one run: every row of a delta, say
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = (index[1:] != index[:-1] + 1) | (segment[1:] != segment[:-1])
    starts = torch.nonzero(new_run).flatten()
    if starts.numel() > 1:
        later = starts[1:]
        gaps = (index[later] - index[later - 1] - 1).to(torch.float64)
        gaps[segment[later] != segment[later - 1]] = float("inf")  # never across objects
        order = torch.argsort(gaps, stable=True)
        within = torch.cumsum(gaps[order], 0) <= extra * n
        merged = torch.zeros(later.numel(), dtype=torch.bool)
        merged[order[within]] = True
        if int((~merged).sum()) + 1 > many:
            merged |= gaps <= merge_rows
        starts = torch.cat([starts[:1], later[~merged]])
    bounds = [*starts.tolist(), n]
    return list(zip(bounds, bounds[1:]))


class SnapshotReader:
    """Reads tensors and objects out of one checkpoint.

    Args:
        storage: the checkpoint root.
        ckpt_id: the checkpoint's directory.
        executor: runs the piece reads; the caller owns it.
        piece_bytes: the most one request reads (``IOOptions.object_bytes``).
        checksums: logical path (see :mod:`torchrec_cnr.schema`) -> CRC32;
            every read of a listed path is checked.

    Raises:
        CheckpointReadError: the directory is missing, was never completed, or its
            metadata is damaged.
    """

    def __init__(
        self,
        storage: Storage,
        ckpt_id: str,
        executor: Executor,
        piece_bytes: int,
        checksums: Mapping[str, int] | None = None,
    ) -> None:
        self.storage = storage
        self.name = ckpt_id
        self.path = storage.path(ckpt_id)
        self.executor = executor
        self.piece_bytes = piece_bytes
        got = storage.read(f"{ckpt_id}/{SNAPSHOT_MARKER}")
        if got is None:
            raise CheckpointReadError(f"checkpoint directory {self.path} is missing or incomplete")
        try:
            self._entries = parse_index(got[0])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointReadError(
                f"{self.path}/{SNAPSHOT_MARKER} is damaged: {brief(e)}"
            ) from e
        self._sums: Mapping[str, int] = {} if checksums is None else checksums
        self._small: list[_Small] = []
        self._small_lock = threading.Lock()

    def _entry(self, logical: str) -> IndexEntry:
        entry = self._entries.get(logical)
        if entry is None:
            raise CheckpointReadError(f"{self.path} holds no {logical!r}")
        return entry

    def _start(self, read: _Read, entry: TensorEntry, target: torch.Tensor) -> None:
        """Queues the reads of one stored tensor entry into the contiguous ``target``."""
        dtype, shape = named_dtype(entry.dtype), list(entry.shape)
        if list(target.shape) != shape or target.dtype != dtype:
            raise CheckpointReadError(
                f"{self.name}/{read.logical}: stored {dtype} {shape}, "
                f"wanted {target.dtype} {list(target.shape)}"
            )
        start = entry.byte_range[0] if entry.byte_range else 0
        crc = read.logical in self._sums
        self._queue(read, target, f"{self.name}/{entry.location}", start, crc)

    def _queue(
        self,
        read: _Read,
        target: torch.Tensor,
        location: str,
        start: int,
        crc: bool,
        cached: bool = False,
    ) -> None:
        """Queues the reads of ``target``'s bytes (of ``read``) from ``location`` at
        ``start``, in pieces of at most ``piece_bytes``, each checksummed if ``crc``."""
        data = as_bytes(target)
        if 0 < len(data) <= min(SMALL_BYTES, self.piece_bytes):
            small = _Small(location, start, data, crc, cached, _Deferred(self.flush))
            with self._small_lock:
                self._small.append(small)
            read.pieces.append((small.future, len(data)))
            return
        step = self.piece_bytes
        for offset in range(0, len(data), step):
            view = data[offset : offset + step]
            future = self.executor.submit(
                _get, self.storage, location, start + offset, view, crc, cached
            )
            read.pieces.append((future, len(view)))

    def flush(self) -> None:
        """Starts reading the small pieces queued (see :data:`SMALL_BYTES`): those of one
        object that lie within a request's worth of bytes of each other, up to
        ``piece_bytes`` in all, with one request. A wait for any of them does it first;
        a caller that begins many reads (windows of several tensors) calls it once they
        are all begun."""
        with self._small_lock:
            queued, self._small = self._small, []
        queued.sort(key=lambda p: (p.location, p.cached, p.start))
        groups: list[list[_Small]] = []
        end = 0  # of the last group's bytes
        for p in queued:
            first = groups[-1][0] if groups else None
            if (
                first is not None
                and (p.location, p.cached) == (first.location, first.cached)
                and p.start <= end + self.storage.request_bytes
                and p.end - first.start <= self.piece_bytes
            ):
                groups[-1].append(p)
                end = max(end, p.end)
            else:
                groups.append([p])
                end = p.end
        for i, group in enumerate(groups):
            try:
                self.executor.submit(_get_together, self.storage, group)
            except Exception as e:  # the executor shut down: no piece left unanswered
                for p in (p for later in groups[i:] for p in later):
                    p.future.set_exception(e)
                return

    def _begin(
        self, logical: str, out: torch.Tensor | None = None, alloc: Alloc | None = None
    ) -> _Read | Any:
        """Starts reading ``logical`` (into ``out`` if given, else into ``alloc``'s tensor
        if it gives one); a value if read at once."""
        entry = self._entry(logical)
        if isinstance(entry, PrimitiveEntry) and entry.type == "bytes":
            return entry.value()
        if not isinstance(entry, TensorEntry | ChunkedTensorEntry):
            raise CheckpointReadError(f"{self.path}: {logical!r} is a {entry.type}, not a tensor")
        dtype, shape = named_dtype(entry.dtype), list(entry.shape)
        if out is None and alloc is not None:
            out = alloc(shape, dtype)
        if out is None or not out.is_contiguous():
            value = _empty(shape, dtype)
        else:
            value = out
        read = _Read(logical, value)
        if isinstance(entry, TensorEntry) and entry.serializer == "buffer_protocol":
            self._start(read, entry, value)
            return read
        read.whole = True
        if isinstance(entry, TensorEntry):  # pickled by torchsnapshot: small, read at once
            start, end = entry.byte_range or (0, None)
            location = f"{self.name}/{entry.location}"
            if end is None:
                got = self.storage.read(location)
                blob = b"" if got is None else got[0]
            else:
                buf = bytearray(end - start)
                self.storage.read_into(location, start, memoryview(buf))
                blob = bytes(buf)
            value.copy_(load_object(blob, (), f"{self.name}/{logical}"))
            return read
        read.whole = False
        for chunk in sorted(entry.chunks, key=lambda c: c.offsets):
            view = value
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, offset, size)
            if not view.is_contiguous():  # chunked along another dim: read each whole
                part = self._finish(self._begin_tensor(logical, chunk.tensor), check=False)
                view.copy_(part)
                read.whole = True
                continue
            self._start(read, chunk.tensor, view)
        return read

    def _begin_tensor(self, logical: str, entry: TensorEntry) -> _Read:
        value = _empty(list(entry.shape), dtype=named_dtype(entry.dtype))
        read = _Read(logical, value)
        self._start(read, entry, value)
        return read

    def _finish(self, read: _Read | Any, check: bool = True, expected: int | None = None) -> Any:
        """Waits for ``read`` and checks its checksum (``expected``, else the recorded
        one); returns the value."""
        if not isinstance(read, _Read):
            return read
        try:  # every piece waited for: none writes into the value after this raises
            crcs = settle([future.result for future, _ in read.pieces])
        except Exception as e:  # a missing or short file, a broken connection, ...
            raise CheckpointReadError(f"cannot read {read.logical!r} from {self.path}: {e}") from e
        crc = 0
        for piece_crc, (_, length) in zip(crcs, read.pieces):
            crc = crc32_combine(crc, piece_crc, length)
        if expected is None:
            expected = self._sums.get(read.logical)
        if check and expected is not None:
            if read.whole:
                crc = crc32(read.value)
            mismatch(crc, expected, f"{self.name}/{read.logical}")
        return read.value

    def _read(self, logical: str, out: torch.Tensor | None = None) -> Any:
        value = self._finish(self._begin_logical(logical, out))
        if out is not None and value is not out:
            out.copy_(value)
            return out
        return value

    def _begin_logical(
        self, logical: str, out: torch.Tensor | None = None, alloc: Alloc | None = None
    ) -> _Read | Any:
        try:
            read = self._begin(logical, out, alloc)
        except CheckpointReadError:
            raise
        except Exception as e:
            raise CheckpointReadError(f"cannot read {logical!r} from {self.path}: {e}") from e
        if not isinstance(read, _Read):  # bytes: check now
            check(read, self._sums.get(logical), f"{self.name}/{logical}")
        return read

    def rows(self, rank: int, name: str) -> torch.Tensor:
        """A stored shard tensor of ``rank``."""
        value = self._read(rows_path(rank, name))
        assert isinstance(value, torch.Tensor), name
        return value

    def dense(self, name: str) -> torch.Tensor:
        value = self._read(dense_path(name))
        assert isinstance(value, torch.Tensor), name
        return value

    def app_state(self, rank: int) -> bytes:
        value = self._read(app_path(rank))
        assert isinstance(value, bytes)
        return value

    def _segments(self, logical: str) -> list[tuple[int, int, TensorEntry]] | None:
        """``(first row, rows, tensor entry)`` of each stored block of rows of a tensor;
        ``None`` if it is not stored as blocks of whole rows."""
        entry = self._entry(logical)
        if isinstance(entry, TensorEntry) and entry.serializer == "buffer_protocol":
            return [(0, entry.shape[0], entry)]
        if not isinstance(entry, ChunkedTensorEntry):
            return None
        out = []
        for chunk in entry.chunks:
            whole_rows = list(chunk.sizes[1:]) == list(entry.shape[1:])
            if not whole_rows or chunk.tensor.serializer != "buffer_protocol":
                return None
            out.append((chunk.offsets[0], chunk.sizes[0], chunk.tensor))
        return sorted(out, key=lambda s: s[0])

    def rows_window(
        self, rank: int, name: str, lo: int, hi: int, blocks: Sequence[int] | None
    ) -> torch.Tensor | None:
        """Rows ``lo..hi - 1`` of a stored shard tensor, reading only the blocks of rows
        they lie in, each checked against its own CRC32 (``blocks``: the record's
        :attr:`~torchrec_cnr.schema.ShardRecord.block_checksums` entry; a tensor stored in
        one block is checked against its whole checksum). ``None`` where that cannot be
        done: a tensor stored otherwise, or in several blocks none recorded.

        Raises:
            CheckpointReadError: a block cannot be read.
            ChecksumError: a block read does not match its checksum.
        """
        finish = self.begin_window(rank, name, lo, hi, blocks)
        return None if finish is None else finish()

    def block_rows(
        self, rank: int, name: str, lo: int, hi: int, blocks: Sequence[int] | None
    ) -> tuple[int, int] | None:
        """``(first, last)``: the rows ``first..last - 1`` of the checked blocks that rows
        ``lo..hi - 1`` of a stored shard tensor lie in, which :meth:`rows_window` reads;
        ``None`` where it cannot read them so (nothing is read)."""
        picked = self._blocks(rows_path(rank, name), lo, hi, blocks)
        if not picked:
            return None
        return picked[0][0], picked[-1][0] + picked[-1][1]

    def _blocks(
        self, logical: str, lo: int, hi: int, blocks: Sequence[int] | None
    ) -> list[tuple[int, int, TensorEntry, int, int]] | None:
        """``(first row, rows, object entry, row in it, CRC32)`` of each stored block of
        rows that rows ``lo..hi - 1`` of ``logical`` lie in, in row order (``blocks``: see
        :meth:`rows_window`); ``None`` where the tensor is not stored in recorded blocks."""
        segments = self._segments(logical)
        if segments is None:
            return None
        if blocks is None and len(segments) == 1:
            blocks = [segments[0][1], self._sums[logical] if logical in self._sums else 0]
        if blocks is None:
            return None
        per, sums = max(1, blocks[0]), blocks[1:]
        cut = [  # (first row, rows, object entry, row in it) of each block, in row order
            (row0 + at, min(per, rows - at), tensor, at)
            for row0, rows, tensor in segments
            for at in range(0, rows, per)
        ]
        if len(cut) != len(sums):
            return None
        return [
            (*block, crc)
            for block, crc in zip(cut, sums)
            if block[0] < hi and block[0] + block[1] > lo
        ]

    def _row_bytes(self, logical: str) -> tuple[int, torch.dtype, list[int]]:
        """``(bytes a row, dtype, shape of a row)`` of a stored tensor of rows."""
        entry = self._entry(logical)
        assert isinstance(entry, TensorEntry | ChunkedTensorEntry)
        dtype = named_dtype(entry.dtype)
        return math.prod(entry.shape[1:]) * dtype.itemsize, dtype, list(entry.shape[1:])

    def begin_window(
        self,
        rank: int,
        name: str,
        lo: int,
        hi: int,
        blocks: Sequence[int] | None,
        cached: bool = False,
        out: torch.Tensor | None = None,
    ) -> Callable[[], torch.Tensor] | None:
        """Starts :meth:`rows_window`'s reads (many windows' run in parallel); the call it
        returns waits for them, checks each block and returns the rows. ``cached``: read
        through the host's cache (see :meth:`~torchrec_cnr.storage.Storage.read_into`).
        ``out``: where the rows go (contiguous, of the stored dtype): the blocks wholly
        among them are read straight into it, the others into buffers of their own and
        their part copied in once checked."""
        logical = rows_path(rank, name)
        picked = self._blocks(logical, lo, hi, blocks)
        if picked is None:
            return None
        first = picked[0][0] if picked else lo
        last = picked[-1][0] + picked[-1][1] if picked else lo
        row_bytes, dtype, row_shape = self._row_bytes(logical)
        value = _empty([last - first, *row_shape], dtype) if out is None else out
        check = logical in self._sums
        reads = []
        for row0, rows, tensor, at, crc in picked:
            if out is None:
                target = value[row0 - first : row0 - first + rows]
            elif lo <= row0 and row0 + rows <= hi:
                target = out[row0 - lo : row0 - lo + rows]
            else:  # only partly wanted
                target = _empty([rows, *row_shape], dtype)
            read = _Read(logical, target)
            start = _row_offset(tensor, at, row_bytes)
            self._queue(read, target, f"{self.name}/{tensor.location}", start, check, cached)
            reads.append((read, row0, rows, crc))

        def finish() -> torch.Tensor:  # every block ended, even after one failed
            settle([functools.partial(self._finish, r, check, crc) for r, _, _, crc in reads])
            for read, row0, rows, _ in reads:
                if out is not None and not (lo <= row0 and row0 + rows <= hi):
                    a, b = max(lo, row0), min(hi, row0 + rows)
                    out[a - lo : b - lo].copy_(read.value[a - row0 : b - row0])
            return value[lo - first : hi - first] if out is None else out

        return finish

    def verify_window(
        self,
        rank: int,
        name: str,
        lo: int,
        hi: int,
        blocks: Sequence[int] | None,
        window_bytes: int,
    ) -> bool:
        """Reads the blocks rows ``lo..hi - 1`` lie in only to check each against its
        CRC32, holding about ``window_bytes`` at once (see :meth:`verify`), through the
        host's cache: a restore reads them again while applying. ``False`` where the tensor
        is not stored in recorded blocks (nothing is read).

        Raises:
            CheckpointReadError: a block cannot be read.
            ChecksumError: a block does not match its checksum.
        """
        logical = rows_path(rank, name)
        picked = self._blocks(logical, lo, hi, blocks)
        if picked is None:
            return False
        if logical not in self._sums:
            return True  # not verified: nothing to read ahead
        row_bytes = self._row_bytes(logical)[0]
        pieces = [
            (f"{self.name}/{tensor.location}", _row_offset(tensor, at, row_bytes),
             rows * row_bytes)
            for _, rows, tensor, at, _ in picked
        ]  # fmt: skip
        got = self._stream(logical, pieces, window_bytes, True, cached=True)
        for (row0, _, _, _, expected), crc in zip(picked, got):
            mismatch(crc, expected, f"{self.name}/{logical} rows from {row0}")
        return True

    def rows_subset(
        self, rank: int, name: str, index: torch.Tensor, extra: float = COALESCE_EXTRA
    ) -> torch.Tensor:
        """Only the rows ``index`` (ascending) of a stored shard tensor, read alone.

        Runs of consecutive rows are read with one request each, and nearby runs of one
        object are merged into one request where the rows between them cost at most
        ``extra`` times the rows wanted (the smallest gaps first): a few large reads
        instead of many tiny ones, at a bounded cost in bytes. The requests run in
        parallel on the executor. No checksum can be checked (it covers the whole
        tensor).
        """
        return self.begin_rows_subset(rank, name, index, extra)()

    def begin_rows_subset(
        self,
        rank: int,
        name: str,
        index: torch.Tensor,
        extra: float = COALESCE_EXTRA,
        buffers: Buffers | None = None,
    ) -> Callable[[], torch.Tensor]:
        """:meth:`rows_subset`, its requests queued on the executor: returns ``finish()``,
        which waits for them and gives the rows, so that the caller can plan the next
        read while these run. ``buffers``: where the rows are read into (else fresh
        memory)."""
        plan = self._subset_plan(rank, name, index, extra, buffers)
        if plan is None:
            rows = self.rows(rank, name)[index]  # pickled or chunked by column: read it whole
            return lambda: rows
        out, tasks = plan
        # A task per batch of spans, not per span: a span is often one small pread.
        batch = max(1, len(tasks) // 16)
        reads: list[Future[None]] = []

        def finish() -> torch.Tensor:
            try:
                settle([read.result for read in reads])  # none writes into ``out`` after
            except Exception as e:
                raise CheckpointReadError(
                    f"cannot read {rows_path(rank, name)!r} from {self.path}: {e}"
                ) from e
            return out

        try:
            for i in range(0, len(tasks), batch):
                reads.append(
                    self.executor.submit(self._read_spans, tasks[i : i + batch], index, out)
                )
        except Exception as e:  # the executor shut down, say: those queued waited for
            reads.append(_failed(e))
            finish()
        return finish

    def subset_cost(
        self, rank: int, name: str, index: torch.Tensor, extra: float = COALESCE_EXTRA
    ) -> tuple[int, int]:
        """``(bytes, requests)`` :meth:`rows_subset` would read (only the index is read)."""
        plan = self._subset_plan(rank, name, index, extra)
        if plan is None:
            return self.nbytes(rank, name), 1
        out, tasks = plan
        row_bytes = out[0].numel() * out.element_size() if out.numel() else 0
        return sum(hi - lo for _, lo, hi, _, _ in tasks) * row_bytes, len(tasks)

    def _subset_plan(
        self,
        rank: int,
        name: str,
        index: torch.Tensor,
        extra: float,
        buffers: Buffers | None = None,
    ) -> tuple[torch.Tensor, list[tuple[tuple[int, int, TensorEntry], int, int, int, int]]] | None:
        """:meth:`rows_subset`'s output, empty, and its reads (see :meth:`_read_spans`);
        ``None`` for a tensor not stored in blocks of whole rows (read whole)."""
        logical = rows_path(rank, name)
        segments = self._segments(logical)
        if segments is None:
            return None
        row_bytes, dtype, row_shape = self._row_bytes(logical)
        if not index.numel():
            return _empty([0, *row_shape], dtype), []
        firsts = torch.tensor([first for first, _, _ in segments])
        segment = torch.searchsorted(firsts, index, right=True) - 1
        storage = self.storage
        spans = _spans(
            index,
            segment,
            extra,
            storage.request_bytes // max(1, row_bytes),
            storage.many_requests,
        )
        starts = torch.tensor([a for a, _ in spans])
        ends = torch.tensor([b for _, b in spans])
        firsts_of = zip(segment[starts].tolist(), index[starts].tolist(), index[ends - 1].tolist())
        tasks = [(segments[k], lo, hi + 1, a, b) for (k, lo, hi), (a, b) in zip(firsts_of, spans)]
        (first, _, tensor), lo, hi, a, b = tasks[0]
        # The first span read straight in (its rows consecutive) lies in the output as in
        # its file: O_DIRECT reads it without a bounce copy (the tail of a delta, say).
        phase = _row_offset(tensor, lo - first, row_bytes) if hi - lo == b - a else 0
        shape = [index.numel(), *row_shape]
        if buffers is not None and buffers.holds(index.numel() * row_bytes):
            return buffers.take(math.prod(shape), dtype, phase).view(shape), tasks
        return _empty(shape, dtype, phase), tasks

    def _read_spans(
        self,
        spans: list[tuple[tuple[int, int, TensorEntry], int, int, int, int]],
        index: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Reads each span ``(segment, lo, hi, a, b)``: stored rows ``lo..hi - 1`` of one
        object with one request, the wanted ones (``index[a:b]``) put at ``out[a:b]``."""
        row_bytes = out[0].numel() * out.element_size()
        for (first, _, tensor), lo, hi, a, b in spans:
            start = _row_offset(tensor, lo - first, row_bytes)
            location = f"{self.name}/{tensor.location}"
            if hi - lo == b - a:  # consecutive: straight into the output
                view = as_bytes(out)[a * row_bytes : b * row_bytes]
                self.storage.read_into(location, start, view)
                continue
            wanted = index[a:b]
            rows = max(1, span_bytes(self.storage) // row_bytes)
            scratch = _scratch(min(hi - lo, rows) * row_bytes).view(out.dtype)
            scratch = scratch.view(-1, *out.shape[1:])
            bounds = torch.searchsorted(wanted, torch.arange(lo, hi, rows)).tolist() + [b - a]
            for i0, i1 in zip(bounds, bounds[1:]):
                if i0 == i1:
                    continue
                r0, r1 = int(wanted[i0]), int(wanted[i1 - 1]) + 1
                chunk = scratch[: r1 - r0]
                self.storage.read_into(location, start + (r0 - lo) * row_bytes, as_bytes(chunk))
                torch.index_select(chunk, 0, wanted[i0:i1] - r0, out=out[a + i0 : a + i1])

    def nbytes(self, rank: int, name: str) -> int:
        """The size of a stored shard tensor of ``rank``, from the index (nothing is read)."""
        entry = self._entry(rows_path(rank, name))
        assert isinstance(entry, TensorEntry | ChunkedTensorEntry), name
        return math.prod(entry.shape) * named_dtype(entry.dtype).itemsize

    def row_bytes(self, rank: int, name: str) -> int:
        """The bytes of one row of a stored shard tensor of ``rank`` (nothing is read)."""
        return self._row_bytes(rows_path(rank, name))[0]

    def rows_like(self, rank: int, name: str) -> torch.Tensor:
        """A tensor on the ``meta`` device of a stored shard tensor's shape and dtype
        (nothing is read)."""
        entry = self._entry(rows_path(rank, name))
        assert isinstance(entry, TensorEntry | ChunkedTensorEntry), name
        return torch.empty(entry.shape, dtype=named_dtype(entry.dtype), device="meta")

    def rows_into(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Reads a stored shard tensor of ``rank`` into ``out`` (straight in where it is
        contiguous), and checks it."""
        self._read(rows_path(rank, name), out)

    def verify(self, rank: int, name: str, window_bytes: int) -> None:
        """Reads a stored shard tensor of ``rank`` only to check its checksum (or, without
        one, that it reads whole), holding at most about ``window_bytes`` of it at once (one
        piece at least): pieces are read in parallel into a few reused buffers, their CRCs
        combined in order.

        Raises:
            CheckpointReadError: the tensor cannot be read.
            ChecksumError: it does not match its recorded checksum.
        """
        logical = rows_path(rank, name)
        expected = self._sums.get(logical)
        segments = self._segments(logical)
        if segments is None:  # not stored in blocks of rows: read whole
            self._read(logical)
            return
        row_bytes = self._row_bytes(logical)[0]
        # About eight pieces in flight, each of whole 4 KiB blocks, 1 MiB at least.
        step = min(self.piece_bytes, max(1 << 20, window_bytes // 8 // DIRECT_ALIGN * DIRECT_ALIGN))
        pieces = [
            (f"{self.name}/{tensor.location}", (tensor.byte_range or (0, 0))[0] + at, length)
            for _, rows, tensor in segments
            for at in range(0, rows * row_bytes, step)
            for length in [min(step, rows * row_bytes - at)]
        ]
        crc = 0  # without a checksum: that it reads whole
        crcs = self._stream(logical, pieces, window_bytes, expected is not None)
        for (_, _, length), got in zip(pieces, crcs):
            crc = crc32_combine(crc, got, length)
        mismatch(crc, expected, f"{self.name}/{logical}")

    def _stream(
        self,
        logical: str,
        pieces: list[tuple[str, int, int]],
        window_bytes: int,
        with_crc: bool,
        cached: bool = False,
    ) -> list[int]:
        """Reads ``(location, start, length)`` pieces of ``logical`` in parallel into a few
        buffers reused, about ``window_bytes`` of them (one piece at least); returns each
        piece's CRC32 (0 without ``with_crc``)."""
        largest = max((length for _, _, length in pieces), default=0)
        window = max(1, min(len(pieces), window_bytes // max(1, largest)))
        buffers = [as_bytes(page_aligned(largest, torch.uint8)) for _ in range(window)]
        crcs: list[int] = []
        inflight = collections.deque[Future[int]]()
        try:
            for i, (location, start, length) in enumerate(pieces):
                if len(inflight) == window:  # its buffer is the one this piece reuses
                    crcs.append(inflight.popleft().result())
                view = buffers[i % window][:length]
                inflight.append(
                    self.executor.submit(
                        _get, self.storage, location, start, view, with_crc, cached
                    )
                )
            crcs += [future.result() for future in inflight]
        except Exception as e:
            for future in inflight:  # no read may outlive its buffer
                future.cancel()
            for future in inflight:
                try:
                    future.result()
                except BaseException:
                    pass
            raise CheckpointReadError(f"cannot read {logical!r} from {self.path}: {e}") from e
        return crcs

    def read_many(
        self,
        wanted: list[tuple[int, str]],
        alloc: Callable[[tuple[int, str], list[int], torch.dtype], torch.Tensor | None]
        | None = None,
    ) -> dict[tuple[int, str], torch.Tensor]:
        """Reads many shard tensors ``(rank, name)`` at once, every piece in parallel.

        ``alloc(key, shape, dtype)``, if given, may give the tensor to read ``key`` into
        (a reused buffer, whose pages are already faulted in). Where one fails, every
        read begun has ended when it raises: none writes into such a buffer after.
        """
        return self.begin_many(wanted, alloc)()

    def begin_many(
        self,
        wanted: list[tuple[int, str]],
        alloc: Callable[[tuple[int, str], list[int], torch.dtype], torch.Tensor | None]
        | None = None,
    ) -> Callable[[], dict[tuple[int, str], torch.Tensor]]:
        """Begins :meth:`read_many`'s reads; the call it returns waits for every one and
        returns the tensors (raising the first failure once all have ended)."""
        reads: dict[tuple[int, str], _Read | Any] = {}
        begun: list[Callable[[], object]] = []
        with ending_first(begun):
            for key in wanted:
                into = None if alloc is None else functools.partial(alloc, key)
                reads[key] = self._begin_logical(rows_path(*key), alloc=into)
                begun.append(functools.partial(self._finish, reads[key], False))
        self.flush()

        def finish() -> dict[tuple[int, str], torch.Tensor]:
            values = settle([functools.partial(self._finish, read) for read in reads.values()])
            return dict(zip(reads, values))

        return finish
