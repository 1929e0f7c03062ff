"""Reading the chain of one committed checkpoint: its links, baseline first.

A restore, a compaction, a read of a table without a model and an export all read a
chain the same way: one :class:`~torchrec_cnr.snapshot.SnapshotReader` per link, the
saved row ids of each shard record, stored tensors fetched by (link, rank, name). A reader
holds nothing its callers put in: a plan carried out (:func:`~torchrec_cnr.read.plan.carry_out`)
returns a new reader that holds what it read (a restore reads and verifies everything
before it changes anything).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Self

import torch

from torchrec_cnr.encoding import ShardRecord
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.manifest import Manifest, Summary
from torchrec_cnr.read.items import ReadItem, TensorKey
from torchrec_cnr.snapshot import SnapshotReader
from torchrec_cnr.snapshot.reader import ending_first, settle
from torchrec_cnr.storage import Root, Storage, as_storage

__all__ = ["ChainReader", "TensorKey", "find_ids", "missing_step"]


def missing_step(manifest: Manifest, step: int | None, url: str) -> ValueError:
    """The error for a step with no committed checkpoint (``None``: the root has none)."""
    return ValueError(
        f"no committed checkpoint of step {step} in {url}; committed steps: {manifest.steps()}"
    )


class ChainReader:
    """The chain of one committed checkpoint, read link by link.

    Args:
        storage: the root.
        manifest: the committed manifest that names ``entry``.
        entry: the checkpoint whose chain is read (its record is read here).
        io: runs the reads, in pieces of at most ``io.object_bytes``; the caller owns it
            (see :meth:`open` for a reader that owns its own).
        verify: check every tensor read whole against the checksum recorded at save time.
        lazy: read a link's index only once something is read from it (a follower that
            reads the last link alone does not read the others'); else every link's index
            is read here, and a missing link fails at once.
        only_rank: read only this storage rank's shard records (a restore onto the
            sharding that rank saved, see ``restore.apply``); every rank's if ``None``.
        links: the chain's checkpoints, if known (see :meth:`narrowed`); else read from
            the manifest when first used.
        held: stored tensors read already, by ``(link, rank, name)``, served from memory
            (see :meth:`holding`).

    Raises:
        ManifestError: a checkpoint of the chain is not in the manifest.
        CheckpointReadError: a checkpoint of the chain is missing or incomplete (when
            its index is read).
    """

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        entry: Summary,
        io: IOContext,
        verify: bool = True,
        lazy: bool = False,
        only_rank: int | None = None,
        links: list[Summary] | None = None,
        held: Mapping[TensorKey, torch.Tensor] | None = None,
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.entry = manifest.record(entry)
        """The checkpoint's whole entry (its record)."""
        self.only_rank = only_rank
        self._links = links
        self.verify = verify
        self.io = io
        self._snapshots: dict[str, SnapshotReader] = {}
        self._kept: dict[tuple[str, int, str], torch.Tensor] = {}
        if not lazy:
            for link in self.links:
                self.snapshot(link)
        self.held: Mapping[TensorKey, torch.Tensor] = MappingProxyType(dict(held or {}))
        """Tensors read ahead (:meth:`holding`), served from memory."""
        self._owned: IOContext | None = None

    @property
    def links(self) -> list[Summary]:
        """The chain's checkpoints, baseline first (a lazy reader reads them when first
        used: a follower's warm update need not)."""
        if self._links is None:
            self._links = self.manifest.links(self.entry)
        return self._links

    def narrowed(self, links: list[Summary], only_rank: int | None = None) -> Self:
        """A reader of ``links`` alone (committed checkpoints of this root, oldest first,
        the last one its entry), sharing this reader's open checkpoints; of storage rank
        ``only_rank``'s shard records alone if given (else as this reader)."""
        rank = self.only_rank if only_rank is None else only_rank
        return self._sharing(links, rank, {})

    def holding(self, held: Mapping[TensorKey, torch.Tensor]) -> Self:
        """This reader, also holding ``held`` (see :func:`~torchrec_cnr.read.plan.carry_out`)."""
        return self._sharing(self.links, self.only_rank, {**self.held, **held})

    def _sharing(
        self, links: list[Summary], only_rank: int | None, held: Mapping[TensorKey, torch.Tensor]
    ) -> Self:
        """A reader of ``links`` sharing this one's open checkpoints and kept tensors."""
        sub = type(self)(
            self.storage,
            self.manifest,
            links[-1],
            self.io,
            self.verify,
            True,
            only_rank,
            links,
            held,
        )
        sub._snapshots, sub._kept = self._snapshots, self._kept
        return sub

    @classmethod
    def open(
        cls,
        root: Root,
        step: int | None = None,
        verify: bool = True,
        io: IOContext | IOOptions | None = None,
    ) -> ChainReader:
        """The chain of ``root``'s committed checkpoint of ``step`` (the latest if ``None``).

        ``io``: the caller's I/O context, or the options of one the reader builds for
        itself and :meth:`close` shuts down (the environment's if ``None``).

        Raises:
            ValueError: no committed checkpoint has ``step`` (or the root has none).
            ManifestError: the manifest is damaged.
            CheckpointReadError: a checkpoint of the chain is missing.
        """
        owned = None if isinstance(io, IOContext) else IOContext(io)
        context = owned if owned is not None else io
        assert isinstance(context, IOContext)
        try:
            storage = as_storage(root, context.options)
            manifest = Manifest.load(storage)
            entry = manifest.find(step)
            if entry is None:
                raise missing_step(manifest, step, storage.url)
            reader = cls(storage, manifest, entry, context, verify)
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        reader._owned = owned
        return reader

    def close(self) -> None:
        """Shuts down the I/O context :meth:`open` made; nothing otherwise."""
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> ChainReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self, entry: Summary) -> SnapshotReader:
        """The reader of committed checkpoint ``entry`` (a link or any other of the root),
        made once."""
        reader = self._snapshots.get(entry.id)
        if reader is None:
            sums = self.manifest.checksums(entry) if self.verify else None
            reader = SnapshotReader(self.storage, entry.id, self.io.io, self.io.object_bytes, sums)
            self._snapshots[entry.id] = reader
        return reader

    def reader(self, n: int) -> SnapshotReader:
        """The reader of link ``n`` (``-1``: the chain's checkpoint, its links unread)."""
        return self.snapshot(self.entry if n == -1 else self.links[n])

    def kept(self, entry: Summary, rank: int, name: str) -> torch.Tensor:
        """A stored tensor of any committed checkpoint of the root, read once and kept
        (shared with :meth:`narrowed` readers; held already if ``entry`` is a link)."""
        links = self._links or ()  # nothing is held before they are read
        n = next((i for i, link in enumerate(links) if link.id == entry.id), None)
        held = None if n is None else self.held.get((n, rank, name))
        if held is not None:
            return held
        key = (entry.id, rank, name)
        tensor = self._kept.get(key)
        if tensor is None:
            tensor = self._kept[key] = self.snapshot(entry).rows(rank, name)
        return tensor

    def records(self, table: str) -> list[tuple[int, ShardRecord]]:
        """``(link index, shard record)`` of every saved shard of ``table`` that saved
        rows, baseline first: later links win."""
        return self._by_table.get(table, [])

    def link_records(self, n: int) -> list[ShardRecord]:
        """The shard records of link ``n`` (``-1``: the chain's checkpoint) this reader
        uses: with :attr:`only_rank`, that storage rank's alone (its part of each record)."""
        return self.manifest.shards(self.entry if n == -1 else self.links[n], self.only_rank)

    @functools.cached_property
    def _by_table(self) -> dict[str, list[tuple[int, ShardRecord]]]:
        out: dict[str, list[tuple[int, ShardRecord]]] = {}
        for n in range(len(self.links)):
            for rec in self.link_records(n):
                if rec.saved_rows > 0:
                    out.setdefault(rec.spec.table, []).append((n, rec))
        return out

    def tensor(self, n: int, rank: int, name: str) -> torch.Tensor:
        """A stored tensor of link ``n``: from memory if held, else read (and verified)."""
        held = self.held.get((n, rank, name))
        return held if held is not None else self.reader(n).rows(rank, name)

    def fetch(self, n: int, rec: ShardRecord) -> Callable[[str], torch.Tensor]:
        """``read(name)`` of ``rec``'s stored tensors, for :func:`~torchrec_cnr.encoding.decode_weight`."""
        return lambda name: self.tensor(n, rec.spec.rank, name)

    def subset(self, n: int, rec: ShardRecord, name: str, keep: torch.Tensor) -> torch.Tensor:
        """Rows ``keep`` (ascending positions) of a stored tensor. Without verification
        only their bytes are read; with it, the whole tensor is (its checksum covers it)."""
        if self.verify or (n, rec.spec.rank, name) in self.held:
            return self.tensor(n, rec.spec.rank, name)[keep]
        return self.reader(n).rows_subset(rec.spec.rank, name, keep)

    def saved_ids(self, n: int, rec: ShardRecord) -> torch.Tensor:
        """``(saved_rows,)`` int64 global ids of the rows ``rec`` (of link ``n``) saved."""
        ss = rec.spec
        if rec.all_rows:
            return torch.arange(ss.row_offset, ss.row_offset + ss.rows)
        return self.tensor(n, ss.rank, rec.ids_name(rec.key)).to(torch.int64)

    def locate(
        self, n: int, rec: ShardRecord, wanted: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Which of ``wanted`` (ascending global ids) ``rec`` (of link ``n``) stores, and
        where: ``(ids, positions)`` pieces, each ascending in both.

        A ``tail`` record's rows changed since the previous checkpoint are found in its
        small ``recent`` tensor, stored last; its other ids are read only if some wanted
        rows are not among those (a follower more than one checkpoint behind).
        """
        pieces = []
        saved: torch.Tensor | None = None
        link = self.links[n]
        if (tail := self._tail(link, rec)) is not None:
            start, last = tail
            hit, at = find_ids(last, wanted)
            if bool(hit.any()):
                pieces.append((wanted[hit], start + at[hit]))
                wanted = wanted[~hit]
            if wanted.numel():
                saved = self._kept_ids(link, rec)[:start]  # the others, ascending
        elif wanted.numel():
            saved = self._kept_ids(link, rec)
        if saved is not None and saved.numel():
            hit, at = find_ids(saved, wanted)
            if bool(hit.any()):
                pieces.append((wanted[hit], at[hit]))
        return pieces

    def stored(self, n: int, rec: ShardRecord) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every row ``rec`` (of link ``n``) stores, and where: ``(ids, positions)`` pieces,
        each ascending in both (a ``tail`` record's rows changed since the previous
        checkpoint are a piece of their own)."""
        link = self.links[n]
        ids = self._kept_ids(link, rec)
        if (tail := self._tail(link, rec)) is None:
            return [(ids, torch.arange(ids.numel()))]
        start, last = tail
        return [(ids[:start], torch.arange(start)), (last, torch.arange(start, rec.saved_rows))]

    def _tail(self, entry: Summary, rec: ShardRecord) -> tuple[int, torch.Tensor] | None:
        """A ``tail`` record's rows changed since the previous checkpoint: where they start
        among its stored rows, and their ids (ascending, from its small ``recent`` tensor);
        ``None`` for any other record."""
        if rec.recent != "tail" or not rec.recent_rows:
            return None
        ids = self.kept(entry, rec.spec.rank, rec.recent_name).to(torch.int64)
        return rec.saved_rows - rec.recent_rows, ids

    def _kept_ids(self, entry: Summary, rec: ShardRecord) -> torch.Tensor:
        """:meth:`saved_ids` of ``rec`` of ``entry``, kept (:meth:`kept`)."""
        ss = rec.spec
        if rec.all_rows:
            return torch.arange(ss.row_offset, ss.row_offset + ss.rows)
        return self.kept(entry, ss.rank, rec.ids_name(rec.key)).to(torch.int64)

    def windows(
        self, items: list[ReadItem], cached: bool = False, out: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The rows of spans ``items``, every read in parallel: only the blocks they lie in
        are read and checked where the record has their checksums
        (:attr:`ReadItem.blocks`), else the whole tensor. ``cached``: through the host's
        cache (read a second time, see :meth:`check`); ``out``: where each span's rows go
        (see :meth:`~torchrec_cnr.snapshot.SnapshotReader.begin_window`)."""
        into: list[torch.Tensor | None] = list(out) if out is not None else [None] * len(items)
        started = []
        begun: list[Callable[[], object]] = []
        with ending_first(begun):  # none writes into ``out`` after this raised
            for item, dst in zip(items, into):
                assert item.span is not None
                reader = self.reader(item.link)
                finish = reader.begin_window(
                    item.rank, item.tensor, *item.span, item.blocks, cached, dst
                )
                started.append((item, dst, finish))
                if finish is not None:
                    begun.append(finish)
        for link in {item.link for item in items}:
            self.reader(link).flush()  # their small pieces, read together
        return settle([functools.partial(self._window, *each) for each in started])

    def _window(
        self, item: ReadItem, dst: torch.Tensor | None, finish: Callable[[], torch.Tensor] | None
    ) -> torch.Tensor:
        """A span's rows, waited for (``finish``), else read whole and cut (the record has
        no checksums of its blocks)."""
        if finish is not None:
            return finish()
        lo, hi = item.span or (0, 0)
        rows = self.reader(item.link).rows(item.rank, item.tensor)[lo:hi]
        return rows if dst is None else dst.copy_(rows)

    def check(self, item: ReadItem, window_bytes: int) -> None:
        """Reads ``item`` only to check it, about ``window_bytes`` at a time, through the
        host's cache where it is a span (read again while applying): the blocks it lies in
        where the record has their checksums, else the whole tensor."""
        reader = self.reader(item.link)
        if item.span is not None:
            if reader.verify_window(item.rank, item.tensor, *item.span, item.blocks, window_bytes):
                return
        reader.verify(item.rank, item.tensor, window_bytes)

    def nbytes(self, n: int, rank: int, name: str) -> int:
        """The size of a stored tensor of link ``n`` (nothing is read)."""
        return self.reader(n).nbytes(rank, name)

    def read_into(self, n: int, rank: int, name: str, out: torch.Tensor) -> None:
        """A stored tensor of link ``n`` into ``out``: copied if held, else read straight
        into it (and checked)."""
        held = self.held.get((n, rank, name))
        if held is not None:
            out.copy_(held)
        else:
            self.reader(n).rows_into(rank, name, out)

    def dense(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The dense state (of the chain's last link), all of it or ``names``."""
        wanted = list(self.entry.dense) if names is None else names
        return {name: self.reader(-1).dense(name) for name in wanted}

    def app_state(self, rank: int) -> bytes:
        """The serialized ``app_state`` of ``rank``, from the chain's last link."""
        return self.reader(-1).app_state(rank)


def find_ids(ids: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each of ``wanted`` is in ``ids`` (both ascending, ``ids`` distinct), and
    where."""
    n = ids.numel()
    if n == 0:
        return torch.zeros(wanted.numel(), dtype=torch.bool), wanted.new_zeros(wanted.numel())
    if ids.shape == wanted.shape and torch.equal(ids, wanted):  # an update's usual case
        return torch.ones(n, dtype=torch.bool), torch.arange(n)
    first = int(ids[0])
    if int(ids[-1]) - first == n - 1:  # distinct and ascending: a run, every row of a shard
        at = wanted - first
        return (at >= 0) & (at < n), at.clamp(0, n - 1)
    if 4 * n < wanted.numel():  # few ids among many wanted: search for each id instead
        pos = torch.searchsorted(wanted, ids).clamp_max(wanted.numel() - 1)
        found = wanted[pos] == ids
        hit = torch.zeros(wanted.numel(), dtype=torch.bool)
        hit[pos[found]] = True
        at = torch.zeros(wanted.numel(), dtype=torch.int64)
        at[pos[found]] = torch.arange(n)[found]
        return hit, at
    at = torch.searchsorted(ids, wanted).clamp_max(n - 1)
    return ids[at] == wanted, at
