"""The manifest, read and committed: the versioned contract between save and restore.

One JSON file, ``<root>/manifest.json``, names every committed checkpoint (its types and
JSON are :mod:`.records`'): the latest ones by their summaries, the older
ones through the newest sealed history segment. Each checkpoint's detail is its record,
``<id>/checkpoint.json``, which :meth:`Manifest.record` reads when asked (and its shard
records, where parts hold them, :meth:`Manifest.shards`). The manifest is replaced atomically (write
a temporary file, fsync, rename, fsync the directory) and only after every rank's data, the
record and any new segment are durable, so its rename is the commit: a checkpoint
directory the manifest does not name does not exist for a restore.

Its size is bounded whatever the history: once it holds ``2 * TAIL`` summaries, all but the
last ``TAIL`` go into a new sealed segment (written once, never changed), which names the
segment before it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torchrec_cnr.encoding import write_part
from torchrec_cnr.errors import CheckpointReadError, ManifestError
from torchrec_cnr.manifest.records import (
    Entry,
    ManifestRecord,
    SegmentRef,
    Summary,
    describe,
    parse_record,
    parse_segment,
    record_bytes,
    segment_bytes,
)
from torchrec_cnr.schema import (
    MANIFEST_NAME,
    PREVIOUS_MANIFEST_NAME,
    ShardRecord,
    app_path,
    dense_path,
    parse_checkpoint_id,
    parse_part,
    part_path,
    record_path,
    rows_path,
    segment_name,
)
from torchrec_cnr.storage import PreconditionFailed, Root, Storage, as_storage

__all__ = ["TAIL", "Keep", "Manifest", "read_part", "read_record"]


TAIL = 4
"""Summaries a manifest keeps after sealing the older ones into a history segment."""


@dataclass(frozen=True)
class Keep:
    """What a commit hook keeps of the root while it works (see
    :class:`~torchrec_cnr.commit.job.CommitHook`): a compaction in flight keeps the
    checkpoint it compacts and the chain it reads."""

    seq: int
    """Checkpoints from this sequence number on stay out of the sealed history, where a
    compaction could not be placed after the one it compacts, nor the checkpoints that
    link to it be linked to the compaction instead (:meth:`Manifest.land`)."""
    ids: frozenset[str]
    """Checkpoints retention keeps."""


class _Source:
    """The storage a manifest's records and segments are read from. Not pickled: a
    manifest sent to another rank reads them once :meth:`Manifest.attach` gives it one."""

    def __init__(self, storage: Storage | None) -> None:
        self.storage = storage

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage = None

    def get(self) -> Storage:
        if self.storage is None:
            raise RuntimeError(
                "a manifest received from another rank needs Manifest.attach(storage)"
            )
        return self.storage


_T = TypeVar("_T")


def _read_file(storage: Storage, name: str, parse: Callable[[bytes, str], _T]) -> _T:
    """``parse(data, where)`` of a file of a checkpoint directory.

    Raises:
        CheckpointReadError: the file is missing or damaged.
    """
    got = storage.read(name)
    if got is None:
        raise CheckpointReadError(f"{storage.path(name)} is missing")
    try:
        return parse(got[0], storage.path(name))
    except ManifestError as e:
        raise CheckpointReadError(str(e)) from e


def read_record(storage: Storage, ckpt_id: str) -> Entry:
    """The entry of checkpoint ``ckpt_id``, from its record.

    Raises:
        CheckpointReadError: the record is missing or damaged.
    """
    return _read_file(
        storage, record_path(ckpt_id), lambda data, where: parse_record(data, where, ckpt_id)
    )


def read_part(storage: Storage, ckpt_id: str, rank: int | None, checksum: str) -> list[ShardRecord]:
    """The shard records of storage rank ``rank``'s part of a checkpoint (``None``: the
    part with every rank's), format 7.

    Raises:
        CheckpointReadError: the part is missing or damaged.
    """
    return _read_file(
        storage, part_path(ckpt_id, rank), lambda data, where: parse_part(data, where, checksum)
    )


class Manifest(ManifestRecord):
    """The manifest of a checkpoint root, read from and committed to its storage."""

    @classmethod
    def load(cls, root: Root, *, fallback: bool = False) -> Manifest:
        """Reads the root's manifest; an empty one if the root has none yet.

        Args:
            root: the root: a :class:`Storage`, a path or a URL.
            fallback: if the manifest is damaged or missing while a previous committed
                manifest exists, use that one (with a warning) instead of failing.

        Raises:
            ManifestError: the manifest is damaged, of another format version, or missing
                while the root shows it had one; the message says whether the previous
                committed manifest is intact.
        """
        storage = as_storage(root)
        where = storage.path(MANIFEST_NAME)
        got = storage.read(MANIFEST_NAME)
        if got is None and not storage.exists(PREVIOUS_MANIFEST_NAME):
            return cls().attach(storage)  # a fresh root
        if got is not None:
            try:
                manifest = cls.parse(got[0], where)
                manifest.version = got[1]
                return manifest.attach(storage)
            except ManifestError as e:
                problem = str(e)
        else:
            problem = f"{where} is missing, but the root holds a previous committed manifest"
        previous = cls.previous(storage)
        if previous is not None and fallback:
            warnings.warn(
                f"{problem}; using the previous committed manifest ({describe(previous)})",
                stacklevel=2,
            )
            # The next commit replaces what is there now, damaged or not.
            previous.version = None if got is None else got[1]
            return previous.attach(storage)
        hint = (
            f"; the previous committed manifest {PREVIOUS_MANIFEST_NAME} is intact "
            f"({describe(previous)}): CheckpointConfig(manifest_fallback=True) uses it"
            if previous is not None
            else f"; no intact {PREVIOUS_MANIFEST_NAME} to fall back to"
        )
        raise ManifestError(problem + hint)

    @classmethod
    def previous(cls, root: Root) -> Manifest | None:
        """The previous committed manifest, if it exists and is intact."""
        storage = as_storage(root)
        got = storage.read(PREVIOUS_MANIFEST_NAME)
        if got is None:
            return None
        try:
            return cls.parse(got[0], storage.path(PREVIOUS_MANIFEST_NAME)).attach(storage)
        except ManifestError:
            return None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._source = _Source(None)
        self._records: dict[str, Entry] = {e.id: e for e in self.tail if isinstance(e, Entry)}
        """The records read or added, by id."""
        self._parts: dict[tuple[str, int | None], list[ShardRecord]] = {}
        """The parts of shard records read (format 7), by checkpoint id and storage rank."""
        self._unrecorded: list[str] = list(self._records)
        """Checkpoints whose records :meth:`save` writes first: those added, and a
        format-1-5 manifest's (whole, without records until the root is first written)."""
        self._rechained: list[str] = []
        """Checkpoints whose chain :meth:`land` changed: their records are written again."""

    def record(self, entry: Summary | str) -> Entry:
        """The whole entry of a committed checkpoint (or its id): its record, read once.

        Raises:
            CheckpointReadError: the record is missing or damaged.
        """
        ckpt_id = entry if isinstance(entry, str) else entry.id
        found = self._records.get(ckpt_id)
        if found is None:
            found = self._records[ckpt_id] = read_record(self._source.get(), ckpt_id)
        return found

    def shards(self, entry: Summary | str, rank: int | None = None) -> list[ShardRecord]:
        """The shard records of a committed checkpoint, every storage rank's or ``rank``'s
        alone: from the record, or from that rank's part (format 7), read once.

        Raises:
            CheckpointReadError: the record or the part is missing or damaged.
        """
        record = self.record(entry)
        if record.shards is not None:
            return (
                record.shards if rank is None else [s for s in record.shards if s.spec.rank == rank]
            )
        if rank is not None and str(rank) not in record.shard_parts:  # no part of its own
            return [s for s in self.shards(record) if s.spec.rank == rank]
        key = "all" if rank is None else str(rank)
        found = self._parts.get((record.id, rank))
        if found is None:
            found = read_part(self._source.get(), record.id, rank, record.shard_parts[key])
            self._parts[(record.id, rank)] = found
        return found

    def checksums(self, entry: Summary | str) -> Mapping[str, int]:
        """Logical tensor path -> CRC32, for every tensor a committed checkpoint stores;
        a storage rank's are read (from its part) when first asked for."""
        return _Checksums(self, self.record(entry))

    def add(self, entry: Entry) -> None:
        """Adds a newly committed checkpoint (its record is written when saved)."""
        self.tail.append(entry.summary())
        self._records[entry.id] = entry
        self._unrecorded.append(entry.id)

    def land(self, compacted: Entry) -> None:
        """Adds a compaction committed after the checkpoint it compacts (see
        :mod:`torchrec_cnr.compaction.background`): right after that checkpoint, and every
        checkpoint that links to it links to the compaction instead (the same state), its
        summary and record rewritten, so that the old chain can go while they stay; the
        checkpoints after them link through them as before.

        Raises:
            ManifestError: the checkpoint it compacts is not among the summaries held (a
                :class:`Keep` keeps it there while the compaction runs).
        """
        at = next((i for i, e in enumerate(self.tail) if e.id == compacted.compacted_from), None)
        if at is None:
            raise ManifestError(
                f"{compacted.compacted_from}, which {compacted.id} compacts, is not among the "
                "summaries the manifest holds"
            )
        self.tail.insert(at + 1, compacted.summary())
        self._records[compacted.id] = compacted
        self._unrecorded.append(compacted.id)
        for i in range(at + 2, len(self.tail)):
            entry = self.tail[i]
            if entry.parent == compacted.compacted_from:
                chain = [compacted.id, entry.id]
                self._records[entry.id] = self.record(entry).rechained(chain)
                self.tail[i] = entry.rechained(chain)
                self._rechained.append(entry.id)

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        manifest = super().parse(data, where)
        if manifest.read_format < 6:  # whole entries: only summaries stay in the tail
            manifest.tail = [e.summary() for e in manifest.tail]
        return manifest

    def attach(self, storage: Storage) -> Manifest:
        """Reads this manifest's records and segments from ``storage`` (a manifest sent
        from another rank, see :class:`_Source`); returns it."""
        self._source.storage = storage
        return self

    def read_history(self) -> list[Summary]:
        """The checkpoints of the sealed history segments, oldest first.

        Raises:
            ManifestError: a segment is missing or damaged.
        """
        storage = self._source.get() if self.history is not None else None
        parts: list[list[Summary]] = []
        ref = self.history
        while ref is not None:
            assert storage is not None
            got = storage.read(ref.name)
            if got is None:
                raise ManifestError(f"{storage.path(ref.name)} (a history segment) is missing")
            entries, previous = parse_segment(got[0], storage.path(ref.name))
            parts.append(entries)
            self._segments.append(ref.name)
            ref = previous
        return [e for part in reversed(parts) for e in part]

    def by_id(self, ckpt_id: str) -> Summary:
        """The committed checkpoint ``ckpt_id`` that a committed chain names: from the
        summaries held, or else from its record alone (no history read).

        Raises:
            ManifestError: the manifest does not name it (and has no history).
            CheckpointReadError: its record is missing or damaged.
        """
        unread = self.history is not None and self._older is None
        if unread and parse_checkpoint_id(ckpt_id) is not None:
            found = next((e for e in self.tail if e.id == ckpt_id), None)
            return found or self.record(ckpt_id)
        return super().by_id(ckpt_id)

    def links(self, entry: Summary) -> list[Summary]:
        """As :meth:`ManifestRecord.links`; a chain walked through records alone that
        reaches a checkpoint the root does not hold is walked again through the history.

        A landing rewrites the records of what links to the checkpoint it compacts before
        its manifest is written; if that write fails, those records name a compaction that
        never committed (whose files then go), where the summaries still name the chain.
        """
        try:
            return super().links(entry)
        except (CheckpointReadError, ManifestError):
            if self.history is None or self._older is not None:
                raise
            self.checkpoints  # noqa: B018 - reads the history: what was committed
            return super().links(self.by_id(entry.id))

    def link(self, ckpt_id: str) -> Summary | None:
        """The checkpoint a committed one links to (``since``), as :meth:`by_id` finds it;
        ``None`` if the root no longer holds it (retired)."""
        try:
            return self.by_id(ckpt_id)
        except ManifestError:
            return None
        except CheckpointReadError:
            if self._source.get().exists(record_path(ckpt_id)):
                raise  # there, but damaged
            return None

    def save(self, storage: Storage, unsealed_from: int | None = None) -> None:
        """Commits this manifest in place of the version it was read at; checkpoints from
        sequence number ``unsealed_from`` on stay out of the sealed history.

        The manifest it replaces stays readable as ``manifest.json.prev``, so one damaged
        manifest never loses the chain. The replacement is one atomic, conditional write:
        if another writer changed the manifest since this one was read, nothing changes.

        Raises:
            PreconditionFailed: the manifest is no longer at :attr:`version`.
        """
        current = storage.read(MANIFEST_NAME)
        found = None if current is None else current[1]
        if found != self.version:
            raise PreconditionFailed(
                f"{storage.path(MANIFEST_NAME)} changed since it was read (another writer?)"
            )
        first = current is None and not storage.exists(PREVIOUS_MANIFEST_NAME)
        for ckpt_id in self._unrecorded:
            entry = self._records[ckpt_id]
            if entry.shard_parts:  # format 7: every rank's shard records in one file too
                assert entry.shards is not None  # a new checkpoint's, in memory
                every = write_part(storage, entry.id, None, entry.shards)
                entry = dataclasses.replace(entry, shard_parts=entry.shard_parts | {"all": every})
                self._records[ckpt_id] = entry
            storage.write(record_path(entry.id), record_bytes(entry))
        for ckpt_id in self._rechained:  # its shard records stay as they are
            storage.write(record_path(ckpt_id), record_bytes(self._records[ckpt_id]))
        self._unrecorded, self._rechained = [], []
        self._seal(storage, unsealed_from)
        if current is not None:
            try:
                Manifest.parse(current[0], MANIFEST_NAME)
                storage.write(PREVIOUS_MANIFEST_NAME, current[0])
            except ManifestError:
                pass  # a damaged manifest never replaces the intact previous one
        self.version = storage.write(MANIFEST_NAME, self.to_bytes(), expect=self.version)
        if first:
            # A first commit leaves an empty previous manifest: from now on a missing
            # manifest means a lost one, not a fresh root. It goes after the manifest, so
            # that a reader (a follower) never finds a previous manifest and no manifest.
            storage.write(PREVIOUS_MANIFEST_NAME, Manifest().to_bytes())
        for name in self._stale_segments:
            storage.delete(name)  # the history a retention replaced
        self._stale_segments = []

    def _seal(self, storage: Storage, unsealed_from: int | None) -> None:
        """Moves all but the last :data:`TAIL` summaries, and those from sequence number
        ``unsealed_from`` on, into a new history segment once that is at least ``TAIL`` of
        them (the segment is durable before the manifest)."""
        cut = len(self.tail) - TAIL
        if unsealed_from is not None:
            cut = min(
                cut, next((i for i, e in enumerate(self.tail) if e.seq >= unsealed_from), cut)
            )
        if cut < TAIL:
            return
        older, self.tail = self.tail[:cut], self.tail[cut:]
        data, digest = segment_bytes(older, self.history)
        count = len(older) + (0 if self.history is None else self.history.count)
        name = segment_name(older[0].seq, older[-1].seq, digest)
        storage.write(name, data)
        if self._older is not None:
            self._older = self._older + older
        self._segments.insert(0, name)
        self.history = SegmentRef(name, older[0].seq, max(e.seq for e in older), count)


class _Checksums(Mapping[str, int]):
    """A checkpoint's logical path -> CRC32, a storage rank's shards read when first asked for."""

    def __init__(self, manifest: Manifest, entry: Entry) -> None:
        self.manifest, self.entry = manifest, entry
        self._ranks: dict[int, dict[str, int]] = {}

    def __getitem__(self, path: str) -> int:
        first, _, rest = path.partition("/")
        kind, _, name = rest.partition("/")
        if not first.isdigit():
            raise KeyError(path)
        rank = int(first)
        if kind == "rows":
            if rank not in self._ranks:
                recs = self.manifest.shards(self.entry, rank)
                self._ranks[rank] = {n: crc for rec in recs for n, crc in rec.checksums.items()}
            return self._ranks[rank][name]
        if kind == "dense" and rank == 0:
            return self.entry.dense_checksums[name]
        if kind == "app" and name == "blob" and rank < len(self.entry.app_checksums):
            return self.entry.app_checksums[rank]
        raise KeyError(path)

    def _paths(self) -> list[str]:
        e = self.entry
        return [
            *(rows_path(r.spec.rank, n) for r in self.manifest.shards(e) for n in r.checksums),
            *(dense_path(n) for n in e.dense_checksums),
            *(app_path(r) for r in range(len(e.app_checksums))),
        ]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths())

    def __len__(self) -> int:
        return len(self._paths())
