"""Writing one rank's part of a checkpoint: encode each staged shard, write its tensors.

Staging hands each shard (or chunk of rows) to a :class:`ShardWriter` as it is copied.
Once staging is done (or a chunk of rows is staged), each shard's encoding
(quantization) runs as a task on the encoding pool, and its tensors go to the I/O pool
as soon as they are ready: encoding uses every core and overlaps the other shards'
writes. A quantized shard is encoded :data:`ENCODE_BYTES` of rows at a time, each piece
written while the next is encoded. Nothing starts during the stall itself, where it would
only compete with the copy for cores and memory bandwidth. The background writer then
calls :meth:`ShardWriter.finish`. Nothing here is collective: each rank writes its own
objects and reports them; the commit gathers the reports and writes the index and the
manifest.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from torchrec_cnr.encoding.codec import ShardRecord, encode_shard
from torchrec_cnr.encoding.formats import FP32, Format, FormatResolver
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.schema import part_bytes, part_path
from torchrec_cnr.snapshot import IndexPart, SnapshotWriter, app_path, crc32, dense_path, rows_path
from torchrec_cnr.staging import StagedCheckpoint, StagedShard
from torchrec_cnr.storage import Storage

__all__ = ["ENCODE_BYTES", "RankWrite", "ShardWriter", "write_part"]

ENCODE_BYTES = 32 << 20
"""Bytes of staged rows a quantizing encode takes at once. Whole, a 1M x 64 shard's 4-bit
rows came out as one fresh 36 MB tensor, above malloc's mmap threshold, so every save
page-faulted it in anew: 17 of the 121 ms one thread took to encode it. In 32 MB pieces
the outputs are small enough for malloc to recycle, and the first ones are written while
the rest are encoded."""


@dataclass
class RankWrite:
    """What one rank reports after writing its part of a checkpoint."""

    shards: list[ShardRecord]
    dense_checksums: dict[str, int]
    app_checksum: int
    nbytes: int
    staged_bytes: int
    stall_s: float
    index: IndexPart = field(default_factory=IndexPart)
    """This rank's torchsnapshot index entries, serialized by this rank."""
    part_checksum: str = ""
    """The checksum of the part holding ``shards`` that this rank wrote (``part_path``)."""


class ShardWriter:
    """Encodes and writes the staged shards of one rank: the :class:`~torchrec_cnr.staging.Sink`
    that staging hands each shard (or chunk) to as soon as it is copied.

    Args:
        storage: the root.
        ckpt_id: the checkpoint directory.
        rank: this rank (names its objects and logical paths).
        resolver: the stored format of each table.
        pools: the encoding and I/O threads (the caller owns them).
    """

    def __init__(
        self,
        storage: Storage,
        ckpt_id: str,
        rank: int,
        resolver: FormatResolver,
        pools: IOContext,
    ) -> None:
        self.ckpt_id = ckpt_id
        self.rank = rank
        self.resolver = resolver
        self.pools = pools
        self.snapshot = SnapshotWriter(storage, ckpt_id, str(rank), pools.io, pools.object_bytes)
        self._records: dict[str, ShardRecord] = {}
        self._queued: list[tuple[StagedShard, int, int | None]] = []
        self._encodes: list[Future[None]] = []
        self._lock = threading.Lock()

    def _encode(self, shard: StagedShard, row0: int, total: int | None) -> None:
        spec = shard.shard.spec
        fmt = self.resolver.resolve(spec.table, spec.num_embeddings)
        n = shard.weight.shape[0]
        row_bytes = shard.weight[:1].numel() * shard.weight.element_size()
        step = n if fmt == FP32 else max(1, ENCODE_BYTES // max(1, row_bytes))
        if step >= n:
            self._write(shard, fmt, row0, total)
            return
        for a in range(0, n, step):
            part = shard.rows(a, min(a + step, n))
            self._write(part, fmt, row0 + a, n if total is None else total)

    def _write(self, shard: StagedShard, fmt: Format, row0: int, total: int | None) -> None:
        """Encodes ``shard`` (rows ``row0..`` of ``total``) and queues its tensors' writes."""
        compiled = self.pools.options.compiled_search
        encoded = encode_shard(shard, fmt, self.resolver.config, compiled)
        with self._lock:
            for name, tensor in encoded.tensors.items():
                if name == encoded.record.recent_name:  # not one row per stored row: whole
                    self.snapshot.write(rows_path(self.rank, name), tensor)
                else:
                    self.snapshot.write(rows_path(self.rank, name), tensor, row0, total)
            known = self._records.get(shard.key)
            if known is None:
                self._records[shard.key] = encoded.record
            else:  # a further chunk of the same shard
                known.saved_rows += encoded.record.saved_rows
                known.nbytes += encoded.record.nbytes
                if encoded.record.recent in ("ids", "tail"):  # the first chunk carries them
                    known.recent = encoded.record.recent
                    known.recent_rows = encoded.record.recent_rows

    def add(self, shard: StagedShard, row0: int = 0, total: int | None = None) -> None:
        """Takes ``shard``, to be encoded and written by :meth:`start`; returns at once.

        ``row0`` and ``total`` place a chunk: its rows start at ``row0`` of the ``total``
        rows the shard stores (all of them if ``None``).
        """
        self._queued.append((shard, row0, total))

    def start(self) -> None:
        """Encodes every shard taken so far on the encoding pool, each written once encoded."""
        pool = self.pools.encode
        self._encodes += [pool.submit(self._encode, *args) for args in self._queued]
        self._queued.clear()

    def wait(self) -> None:
        """Blocks until everything added is durable: the staged buffers may be reused.

        Raises:
            ValueError: a row holds NaN or Inf (the message names table and row).
            OSError: a write failed.
        """
        self.start()
        for future in self._encodes:
            future.result()
        self.snapshot.wait()

    def finish(self, staged: StagedCheckpoint) -> RankWrite:
        """Writes ``staged``'s dense state and ``app_state``; waits for every write."""
        try:
            if staged.rest is not None:
                staged.rest(self)
            self.wait()
            if self.rank == 0:  # replicated: written once, every rank checksums its own copy
                for name, tensor in staged.dense.items():
                    self.snapshot.write(dense_path(name), tensor, replicated=True)
            self.snapshot.add_bytes(app_path(self.rank), staged.app_state)
            part = self.snapshot.finish()
        except BaseException:
            self.abandon()
            raise
        records = list(self._records.values())
        for rec in records:
            rec.take_checksums(part.checksums, part.blocks)
        # This rank's shard records, in a part of their own: rank 0's record names it.
        part_checksum = write_part(self.snapshot.storage, self.ckpt_id, self.rank, records)
        self.snapshot.storage.make_durable(self.ckpt_id)
        dense_bytes = sum(t.numel() * t.element_size() for t in staged.dense.values())
        return RankWrite(
            shards=records,
            dense_checksums={k: crc32(v) for k, v in staged.dense.items()},
            app_checksum=part.checksums[app_path(self.rank)],
            nbytes=part.nbytes,
            staged_bytes=staged.staged_bytes + dense_bytes + len(staged.app_state),
            stall_s=staged.stall_s,
            index=part.index,
            part_checksum=part_checksum,
        )

    def abandon(self) -> None:
        """After a failure: waits for the work in flight, so none outlives the checkpoint."""
        self._queued.clear()
        for future in self._encodes:
            try:
                future.result()
            except BaseException:  # the failure that brought us here is the one to report
                pass
        try:
            self.snapshot.wait()
        except BaseException:
            pass


def write_part(storage: Storage, ckpt_id: str, rank: int | None, records: list[ShardRecord]) -> str:
    """Writes the part of storage rank ``rank`` of a checkpoint (its shard records; every
    rank's if ``None``, see :func:`~torchrec_cnr.schema.part_path`); returns its checksum,
    which the checkpoint's record names."""
    data, checksum = part_bytes(ckpt_id, rank, records)
    storage.write(part_path(ckpt_id, rank), data)
    return checksum
