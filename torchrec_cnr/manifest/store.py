"""The manifest, read and committed: the versioned contract between save and restore.

One JSON file, ``<root>/manifest.json``, names every committed checkpoint (its types and
JSON are :mod:`.records`'): the latest ones by their summaries, the older
ones through the newest sealed history segment. Each checkpoint's detail is its record,
``<id>/checkpoint.json``, read when first used. The manifest is replaced atomically (write
a temporary file, fsync, rename, fsync the directory) and only after every rank's data, the
record and any new segment are durable, so its rename is the commit: a checkpoint
directory the manifest does not name does not exist for a restore.

Its size is bounded whatever the history: once it holds ``2 * TAIL`` summaries, all but the
last ``TAIL`` go into a new sealed segment (written once, never changed), which names the
segment before it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torchrec_cnr.encoding import write_part
from torchrec_cnr.errors import CheckpointReadError, ManifestError
from torchrec_cnr.manifest.records import (
    Entry,
    ManifestRecord,
    SegmentRef,
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
    parse_checkpoint_id,
    parse_part,
    part_path,
    record_path,
    segment_name,
)
from torchrec_cnr.storage import PreconditionFailed, Root, Storage, as_storage

__all__ = ["TAIL", "Keep", "Manifest", "read_record"]


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


class _Record:
    """Reads a checkpoint's record: an entry's detail, fetched on first use."""

    def __init__(self, source: _Source, ckpt_id: str) -> None:
        self.source, self.ckpt_id = source, ckpt_id

    def __call__(self) -> Entry:
        return read_record(self.source, self.ckpt_id)


class _Parts:
    """Reads a storage rank's part of a checkpoint: its shard records (format 7)."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def __call__(self, ckpt_id: str, rank: int | None, checksum: str) -> list[ShardRecord]:
        storage = self.source.get()
        name = part_path(ckpt_id, rank)
        got = storage.read(name)
        if got is None:
            raise CheckpointReadError(f"{storage.path(name)} is missing")
        try:
            return parse_part(got[0], storage.path(name), checksum)
        except ManifestError as e:
            raise CheckpointReadError(str(e)) from e


def read_record(source: _Source | Storage, ckpt_id: str) -> Entry:
    """The entry of checkpoint ``ckpt_id``, from its record (its shards, where parts hold
    them, read from those when first used).

    Raises:
        CheckpointReadError: the record is missing or damaged.
    """
    source = source if isinstance(source, _Source) else _Source(source)
    storage = source.get()
    name = record_path(ckpt_id)
    got = storage.read(name)
    if got is None:
        raise CheckpointReadError(f"{storage.path(name)} is missing")
    try:
        entry = parse_record(got[0], storage.path(name), ckpt_id)
    except ManifestError as e:
        raise CheckpointReadError(str(e)) from e
    return entry.parts_from(_Parts(source))


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
        self._unrecorded: list[Entry] = list(self.tail)
        """Entries whose records :meth:`save` writes first: those added, and a format-1-5
        manifest's (whole, without records until the root is first written)."""
        self._rechained: list[Entry] = []
        """Entries whose chain :meth:`land` changed: their records are written again."""

    def add(self, entry: Entry) -> None:
        """Adds a newly committed checkpoint (its record is written when saved)."""
        self.tail.append(entry)
        self._unrecorded.append(entry)

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
        self.tail.insert(at + 1, compacted)
        self._unrecorded.append(compacted)
        for entry in self.tail[at + 2 :]:
            if entry.parent == compacted.compacted_from:
                for key in ("_parent", "_depth", "_owner"):
                    entry.__dict__.pop(key, None)
                entry.chain = [compacted.id, entry.id]
                self._rechained.append(entry)

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        manifest = super().parse(data, where)
        if manifest.read_format >= 6:  # summaries: each reads its record when first used
            manifest._unrecorded = []
            manifest.tail = [Entry.lazy(e, _Record(manifest._source, e.id)) for e in manifest.tail]
        return manifest

    def attach(self, storage: Storage) -> Manifest:
        """Reads this manifest's records and segments from ``storage`` (a manifest sent
        from another rank, see :class:`_Source`); returns it."""
        self._source.storage = storage
        return self

    def read_history(self) -> list[Entry]:
        """The checkpoints of the sealed history segments, oldest first.

        Raises:
            ManifestError: a segment is missing or damaged.
        """
        storage = self._source.get() if self.history is not None else None
        parts: list[list[Entry]] = []
        ref = self.history
        while ref is not None:
            assert storage is not None
            got = storage.read(ref.name)
            if got is None:
                raise ManifestError(f"{storage.path(ref.name)} (a history segment) is missing")
            entries, previous = parse_segment(got[0], storage.path(ref.name))
            parts.append([Entry.lazy(e, _Record(self._source, e.id)).linked(self) for e in entries])
            self._segments.append(ref.name)
            ref = previous
        return [e for part in reversed(parts) for e in part]

    def by_id(self, ckpt_id: str) -> Entry:
        """The committed checkpoint ``ckpt_id`` that a committed chain names: from the
        summaries held, or else from its record alone (no history read).

        Raises:
            ManifestError: the manifest does not name it (and has no history).
            CheckpointReadError: its record is missing or damaged.
        """
        unread = self.history is not None and self._older is None
        if unread and parse_checkpoint_id(ckpt_id) is not None:
            found = next((e for e in self.tail if e.id == ckpt_id), None)
            return found or read_record(self._source, ckpt_id).linked(self)
        return super().by_id(ckpt_id)

    def link(self, ckpt_id: str) -> Entry | None:
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
        for entry in self._unrecorded:
            if entry.shard_parts:  # format 7: every rank's shard records in one file too
                entry.shard_parts["all"] = write_part(storage, entry.id, None, entry.shards)
            storage.write(record_path(entry.id), record_bytes(entry))
        for entry in self._rechained:  # its shard records stay as they are
            storage.write(record_path(entry.id), record_bytes(entry))
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
