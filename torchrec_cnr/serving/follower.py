"""A follower: keeps a serving model at the latest committed checkpoint of a root.

Check-N-Run names "publishing snapshots in real time" among the reasons to checkpoint:
serving wants fresh embeddings. Each update of a :class:`Follower`

1. reads the root's manifest (only committed checkpoints exist there), unless its stamp (a
   stat on a file system, a HEAD request on S3) shows it unchanged since the last poll;
2. plans which rows changed since the served checkpoint (:mod:`.plan`);
3. reads only those rows' latest versions from the target's chain, newest link first,
   each row once, with ranged reads of consecutive rows (a ranged GET on S3);
4. applies them, with the dense state if it changed, to the serving model under the
   exclusive side of a lock whose shared side serving code takes around its forwards
   (:meth:`Follower.serving`), and names the new step as served under the same hold: a
   lookup sees one committed step, the one :attr:`Follower.step` names, never a mix.

Everything that can fail (a file retired by ``keep_last`` or replaced by compaction
while read, a damaged or missing file, a model that does not match) fails before the
model changes: the follower keeps serving the last good step and tries again at the next
poll, re-planning from the manifest as it is then.

Operating it: :meth:`Follower.pin` stops advancing (at the served step, or at another
committed one), :meth:`Follower.rollback` goes back to an earlier committed step reading
only the rows changed in between, and an accept gate sees each update, read and ready,
before it is served (:func:`finite_rows` by default: no NaN or infinity). A refused update
leaves the last accepted step served; the checkpoint it came from is not read again, and
the next commit's update carries its rows again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr import shutdown
from torchrec_cnr.commit.manifest import Entry, Manifest
from torchrec_cnr.encoding import FP32, ShardRecord
from torchrec_cnr.errors import CnrError
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.quantization import UNIFORM_METHODS
from torchrec_cnr.read import ChainReader, find_ids, load_committed
from torchrec_cnr.restore import check_serving
from torchrec_cnr.schema import MANIFEST_NAME
from torchrec_cnr.serving.plan import UpdatePlan, changed_rows, plan_update
from torchrec_cnr.serving.rows import PreparedRows, StoredRows, memory_bytes
from torchrec_cnr.serving.spill import Spill, piece_bytes, piece_rows
from torchrec_cnr.serving.targets import ServingTarget
from torchrec_cnr.snapshot import SnapshotReader
from torchrec_cnr.storage import CountingStorage, Root, as_storage

__all__ = ["Follower", "PendingUpdate", "RefusedUpdate", "UpdateReport", "finite_rows"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateReport:
    """What one update did."""

    step: int
    """The step served after it."""
    checkpoint: str
    """The served checkpoint's id."""
    rows: int
    """Rows read and applied."""
    bytes_read: int
    """Bytes read from the root (manifest, indexes, ids and rows)."""
    requests: int
    """Requests made to the root (each read, ranged read, stat or listing)."""
    seconds: float
    """From the poll to the update applied."""
    blocked_s: float
    """How long serving was blocked (the exclusive side of the lock)."""
    lag_s: float
    """From the checkpoint's commit to the update applied."""
    cold: bool
    """Every row was read: no recorded path of changes from the served checkpoint."""
    rewind: bool
    """The root's latest checkpoint is older than the one served before."""
    held_bytes: int = 0
    """Memory the update's rows took at once: as read, and in serving form where that is
    not a view of them (the spare copy of swap mode is :attr:`Follower.spare_bytes`); over
    the memory budget, the most one piece took."""
    spilled_bytes: int = 0
    """Over the memory budget: the bytes of the rows in mapped files (page cache)."""


class _SharedLock:
    """Many readers (forwards) or one writer (an update), writers first once waiting."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._writer and not self._waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            self._waiting += 1
            self._cv.wait_for(lambda: not self._writer and not self._readers)
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


@dataclass(frozen=True)
class RefusedUpdate:
    """An update the accept gate refused: the step served stayed."""

    step: int
    """The step it would have served."""
    checkpoint: str
    reason: str
    """What the gate said."""
    at: float = field(default_factory=time.time)


@dataclass
class PendingUpdate:
    """Everything read for one update, ready to apply: what an accept gate sees."""

    plan: UpdatePlan
    rows: list[tuple[str, torch.Tensor, StoredRows]] = field(default_factory=list)
    """(state-dict key, ``(k,)`` ascending global ids, their rows as stored)."""
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    """Dense tensors that change, by state-dict key."""
    spill: Spill | None = None
    """An update over the follower's memory budget: its rows, in serving form, in mapped
    files instead of :attr:`rows` (the gate saw them piece by piece, each as an update of
    its own with the same plan)."""
    refused: str | None = None
    """Why the gate refused one of its pieces, if it did."""

    @property
    def step(self) -> int:
        """The step it serves."""
        return self.plan.target.step

    @property
    def count(self) -> int:
        pieces = [] if self.spill is None else self.spill.pieces
        return sum(int(ids.numel()) for _, ids, _ in [*self.rows, *pieces])


AcceptGate = Callable[[PendingUpdate], str | None]
"""Sees each update before it is served: ``None`` accepts it, a string refuses it (why)."""


def finite_rows(update: PendingUpdate) -> str | None:
    """The default gate: refuses an update holding a NaN or an infinity in a row (as
    stored, dequantized) or a dense tensor; names the first five rows of each table."""
    bad: list[str] = []
    for key, ids, rows in update.rows:
        values = rows.values if rows.values is not None else rows.dequantize()
        finite = torch.isfinite(values).all(dim=1)
        if not bool(finite.all()):
            bad.append(f"{key} rows {ids[~finite][:5].tolist()}")
    bad += [name for name, t in update.dense.items() if not bool(torch.isfinite(t).all())]
    return None if not bad else "non-finite values in " + ", ".join(bad)


@dataclass
class _Piece:
    """Rows ``ids`` of a table, stored at positions ``keep`` of ``rec`` of ``snapshot``'s
    checkpoint."""

    ids: torch.Tensor
    rec: ShardRecord
    keep: torch.Tensor
    snapshot: SnapshotReader

    def cost(self) -> int:
        """The bytes its read fetches, a request counted as ``request_bytes`` more."""
        total = 0
        for name in self.rec.value_names:
            nbytes, requests = self.snapshot.subset_cost(self.rec.spec.rank, name, self.keep)
            total += nbytes + requests * self.snapshot.storage.request_bytes
        return total

    def read(self) -> tuple[torch.Tensor, StoredRows]:
        """``(ids, rows)``, the rows as stored."""
        rec = self.rec

        def read(name: str) -> torch.Tensor:
            return self.snapshot.rows_subset(rec.spec.rank, name, self.keep)

        if rec.format == FP32:
            return self.ids, StoredRows.fp32(read(rec.weight_name(rec.key)))
        parts = {p: read(rec.part_name(rec.key, p)) for p in rec.parts}
        return self.ids, StoredRows.quantized(
            parts, rec.format.method, rec.format.bits, rec.spec.cols
        )


def _same_values(rec: ShardRecord, ours: list[ShardRecord], cols: int) -> bool:
    """Whether ``rec`` stores a row as the target's records of its table would, had the
    row not changed in between: whole rows, fp32, or one uniform format (a row quantizes
    the same way at every save; k-means or a bit width that changed may not)."""
    if rec.spec.cols != cols:
        return False
    if rec.format == FP32:
        return True
    return rec.format.method in UNIFORM_METHODS and all(
        r.format == rec.format and r.parts == rec.parts for r in ours
    )


def _located(
    source: ChainReader, table: str, wanted: torch.Tensor
) -> tuple[list[_Piece], torch.Tensor] | None:
    """Where ``source``'s links, newest first, store rows ``wanted`` of ``table``: each
    row's pieces, and the rows none stores; ``None`` if a record splits the table's rows
    by column (see :func:`_assemble`)."""
    dim = source.entry.tables[table].embedding_dim
    if not all(rec.spec.cols == dim for _, rec in source.records(table)):
        return None
    pieces = []
    for n in reversed(range(len(source.links))):
        for rec in source.links[n].shards:
            if rec.spec.table != table or rec.saved_rows == 0 or not wanted.numel():
                continue
            found = source.locate(n, rec, wanted)
            pieces += [_Piece(ids, rec, keep, source.reader(n)) for ids, keep in found]
            if found:
                wanted = wanted[~torch.isin(wanted, torch.cat([ids for ids, _ in found]))]
    return pieces, wanted


def _from_newer(
    chain: ChainReader, table: str, wanted: torch.Tensor, newer: list[Entry]
) -> tuple[list[_Piece], torch.Tensor]:
    """Rows ``wanted`` of ``table`` from ``newer`` (the checkpoints since the served one,
    newest first: see :attr:`UpdatePlan.newer`), each from the newest that changed it,
    where those rows lie in one run: the pieces, and the rows left."""
    # The target's own records: a row read from a newer checkpoint must be stored as the
    # target stores it (its chain's older links are not read for a warm update).
    ours = [rec for rec in chain.entry.shards if rec.spec.table == table]
    dim = chain.entry.tables[table].embedding_dim
    pieces = []
    deferred = []  # changed by a checkpoint that does not store them in a run
    for entry in newer:
        for rec in entry.shards:
            if rec.spec.table != table or rec.saved_rows == 0 or not wanted.numel():
                continue
            ids, start = changed_rows(chain, entry, rec)
            hit, at = find_ids(ids, wanted)
            if not bool(hit.any()):
                continue
            if start is None or not _same_values(rec, ours, dim):
                # Their value is the target chain's: older checkpoints hold older ones.
                deferred.append(wanted[hit])
            else:
                pieces.append(_Piece(wanted[hit], rec, start + at[hit], chain.snapshot(entry)))
            wanted = wanted[~hit]
    if deferred:
        wanted = torch.sort(torch.cat([wanted, *deferred])).values
    return pieces, wanted


def _read_table(
    chain: ChainReader, table: str, wanted: torch.Tensor | None, newer: list[Entry]
) -> list[tuple[torch.Tensor, StoredRows]]:
    """The latest stored version of rows ``wanted`` (every row if ``None``) of ``table``,
    each row read once: ``(ids, rows)`` pieces.

    A cold update reads them from ``chain``, newest link first. A warm one reads them
    from ``newer`` alone, which stores every row it wants (the target's chain is not
    read): each from the newest checkpoint that changed it where those lie in one run
    (:func:`_from_newer`), the rest from the newest that stores it; or, where the target
    stores them all (a full checkpoint, or a delta since a baseline no later than the
    served one) and that costs less, all from the target (the survivors of older
    checkpoints' runs lie scattered through them)."""
    rows = torch.arange(chain.entry.tables[table].num_embeddings) if wanted is None else wanted
    if not newer:
        return _read_rest(chain, table, [], rows, _located(chain, table, rows))
    source = chain.narrowed(newer[::-1])
    pieces, rest = _from_newer(chain, table, rows, newer)
    found = _located(source, table, rest)
    if len(newer) > 1 and (alone := _located(chain.narrowed([chain.entry]), table, rows)):
        if not alone[1].numel() and (
            found is None
            or sum(p.cost() for p in alone[0]) < sum(p.cost() for p in pieces + found[0])
        ):
            return [p.read() for p in alone[0]]
    return _read_rest(source, table, pieces, rest, found)


def _read_rest(
    source: ChainReader,
    table: str,
    pieces: list[_Piece],
    rest: torch.Tensor,
    found: tuple[list[_Piece], torch.Tensor] | None,
) -> list[tuple[torch.Tensor, StoredRows]]:
    """``pieces`` read, then rows ``rest`` where :func:`_located` ``found`` them in
    ``source`` (``None``: assembled from its links, split by column)."""
    if found is not None:
        return [p.read() for p in pieces + found[0]]
    read = [p.read() for p in pieces]
    if not rest.numel():
        return read
    return [*read, (rest, StoredRows.fp32(_assemble(source, table, rest)))]


def _assemble(source: ChainReader, table: str, wanted: torch.Tensor) -> torch.Tensor:
    """Full fp32 rows ``wanted`` of a table whose rows are split by column (or
    resharded): each from the newest of ``source``'s links that stores all its columns;
    a row no link stores whole, from every link, oldest first (as a restore does)."""
    from torchrec_cnr.read.tables import table_values

    dim = source.entry.tables[table].embedding_dim
    out = torch.zeros(wanted.numel(), dim)
    left = torch.arange(wanted.numel())  # positions in ``wanted`` still to read
    for n in reversed(range(len(source.links))):
        cover = torch.zeros(left.numel(), dtype=torch.int64)  # columns link n stores
        for rec in source.links[n].shards:
            if rec.spec.table == table and rec.saved_rows and left.numel():
                for ids, _ in source.locate(n, rec, wanted[left]):
                    cover[find_ids(wanted[left], ids)[1]] += rec.spec.cols
        whole = cover == dim
        if bool(whole.any()):
            link = source.narrowed([source.links[n]])
            out[left[whole]] = table_values(link, table, wanted[left[whole]])
            left = left[~whole]
    if left.numel():
        out[left] = table_values(source, table, wanted[left])
    return out


class Follower:
    """Keeps ``target`` at the latest committed checkpoint of ``root``.

    Read-only: any number of followers on any number of hosts follow one root without a
    lease, and a writer's commits see only their reads.

    Args:
        root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        target: the serving model, wrapped (:class:`~torchrec_cnr.serving.FloatTarget`
            for the unsharded fp32 model, :class:`~torchrec_cnr.serving.QuantizedTarget`
            for TorchRec's quantized inference model).
        io: the I/O options its reads run with (threads, request size, direct reads);
            the environment's :class:`~torchrec_cnr.IOOptions` if ``None``.
        accept: the accept gate (see :data:`AcceptGate`); ``None`` accepts every update.
        swap: swap mode: the target keeps a second copy of its tables, each update is
            written into it while the served copy serves, and lookups wait only while
            the two are swapped (pointer assignments, plus the dense tensors' copies).
            Costs the tables' size in memory. The default, copy mode, copies an
            update's rows into the served tables with lookups held off: no second copy,
            and lookups wait about a memcpy of the changed rows.
        memory_budget: copy mode: the most bytes an update's rows take in memory; a
            larger update is read in pieces, each shown to the gate, prepared and moved
            into a mapped, unlinked file (:mod:`torchrec_cnr.serving.spill`). ``None``:
            an update's rows are held whole.
        spill_dir: where those files go (on a disk); the temporary folder if ``None``.

    Example::

        follower = Follower("/ckpt/run1", QuantizedTarget(quantize_embeddings(model)))
        follower.poll()                       # the latest committed step, now
        follower.start(interval_s=5.0)        # and every 5 s, on a thread
        with follower.serving():              # forwards see one committed step
            scores = model(batch)
        follower.stop()
    """

    def __init__(
        self,
        root: Root,
        target: ServingTarget,
        io: IOOptions | None = None,
        accept: AcceptGate | None = finite_rows,
        swap: bool = False,
        memory_budget: int | None = None,
        spill_dir: str | None = None,
    ) -> None:
        if memory_budget is not None and (
            not isinstance(memory_budget, int) or isinstance(memory_budget, bool)
            or memory_budget <= 0
        ):  # fmt: skip
            raise ValueError(f"memory_budget must be a positive int (bytes), got {memory_budget!r}")
        if memory_budget is not None and swap:
            raise ValueError("memory_budget bounds copy mode; swap mode holds a second copy")
        if spill_dir is not None and not os.path.isdir(spill_dir):
            raise ValueError(f"spill_dir {spill_dir!r} is not a folder")
        self.memory_budget = memory_budget
        """Copy mode: the most memory an update's rows take (bytes); a larger update is
        prepared piece by piece into files mapped from ``spill_dir`` (``None``: no bound)."""
        self.spill_dir = spill_dir
        self._io = IOContext(io)
        self.accept = accept
        self.storage = CountingStorage(as_storage(root, self._io.options), read_only=True)
        self.target = target
        self._lock = _SharedLock()
        self._served: Entry | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.reports: list[UpdateReport] = []
        """Every update applied, oldest first."""
        self.last_error: Exception | None = None
        """Why the last poll failed, if it did (the last good step stays served)."""
        self.failures = 0
        """Polls that failed (on the polling thread)."""
        self.polls = 0
        """Polls made (:meth:`poll`, on the thread or not)."""
        self.idle_polls = 0
        """Polls that found nothing new to serve, once a step was served."""
        self.idle_requests = 0
        """Requests those polls made (one stat or HEAD each, while the manifest stays)."""
        self.refused: list[RefusedUpdate] = []
        """Updates the accept gate refused, oldest first."""
        self._pinned = False
        self._updating = threading.Lock()  # one update at a time: polls, pins, rollbacks
        self._seen: str | None = None  # the manifest's stamp when last planned from
        self.spare_bytes = target.enable_swap() if swap else 0
        """Memory the second copy of the tables takes (swap mode)."""
        self._behind: list[tuple[str, torch.Tensor, PreparedRows]] | None = []
        """Swap mode: what the spare copy lacks of the served step (``None``: unknown,
        copied whole before the next update)."""

    @property
    def step(self) -> int | None:
        """The step served; ``None`` before the first update."""
        return None if self._served is None else self._served.step

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Hold this around each forward: updates wait for it, and it waits for them."""
        return self._lock.shared()

    @property
    def pinned(self) -> bool:
        """Whether polls leave the served step as it is (:meth:`pin`)."""
        return self._pinned

    def poll(self) -> int | None:
        """Applies whatever was committed since the served checkpoint; returns the step
        served after it (``None`` while the root holds no checkpoint). Pinned, it reads
        nothing and returns the served step.

        Raises:
            ModelMismatchError: the checkpoint's tables or dense tensors do not match the
                serving model; nothing changed.
            CheckpointReadError, ManifestError: a file is missing or damaged; nothing
                changed, and the last good step stays served.
        """
        with self._updating:
            self.polls += 1
            if self._pinned:
                return self.step
            served, requests = self._served, self.storage.requests
            step = self._update(None)
            if served is not None and self._served is served:
                self.idle_polls += 1
                self.idle_requests += self.storage.requests - requests
            return step

    def pin(self, step: int | None = None) -> int | None:
        """Stops advancing: polls keep the served step until :meth:`unpin`. Given a
        committed ``step``, serves it first (older or newer than the served one), reading
        only the rows that differ. Returns the step served.

        Raises:
            ValueError: no committed checkpoint has ``step`` (retention may have removed
                it); the served step did not change (the follower is pinned to it).
            CnrError: the accept gate refused that step; likewise.
        """
        with self._updating:
            self._pinned = True
            if step is not None and step != self.step:
                refused = len(self.refused)
                self._update(step)
                if len(self.refused) > refused:
                    raise CnrError(f"step {step} was refused: {self.refused[-1].reason}")
            return self.step

    def unpin(self) -> None:
        """Follows the root's latest step again, from the next poll."""
        self._pinned = False

    def rollback(self, step: int) -> int | None:
        """Serves the earlier committed ``step`` and stays there (pinned): a harmful
        update undone in the time of an update, not of a reload. :meth:`unpin` follows
        the latest again.

        Raises:
            ValueError: ``step`` is not older than the served step, or no committed
                checkpoint has it; nothing changed.
        """
        if self.step is None or step >= self.step:
            raise ValueError(f"rollback needs a step older than the served {self.step}, got {step}")
        return self.pin(step)

    def _update(self, step: int | None) -> int | None:
        began = time.perf_counter()
        start_bytes, start_requests = self.storage.bytes_read, self.storage.requests
        stamp = self.storage.stamp(MANIFEST_NAME)
        if step is None and stamp is not None and stamp == self._seen:
            return self.step  # nothing committed or retired since: one stat or HEAD
        # Retired by keep_last or replaced by compaction while read: planned again.
        loaded = load_committed(
            lambda: Manifest.load(self.storage),
            step,
            lambda manifest, entry: self._read(manifest, entry, asked=step is not None),
            self.storage.url,
        )
        update = None if loaded is None else loaded[1]
        if update is None:
            self._seen = stamp
            return self.step
        plan = update.plan
        if plan.rewind and step is None:
            logger.warning(
                "%s went back to step %d (it served step %d): the job restored an older "
                "checkpoint; following the root's latest",
                self.storage.url,
                plan.target.step,
                self.step,
            )
        reason = update.refused
        if reason is None and self.accept is not None:
            reason = self.accept(update)
        if reason is not None:
            self._seen = stamp
            self.refused.append(RefusedUpdate(plan.target.step, plan.target.id, reason))
            logger.warning(
                "follower of %s: step %d refused (%s); serving step %s",
                self.storage.url,
                plan.target.step,
                reason,
                self.step,
            )
            return self.step
        blocked, held = self._apply(update)
        self._seen = stamp if step is None else None
        now = time.perf_counter()
        report = UpdateReport(
            step=plan.target.step,
            checkpoint=plan.target.id,
            rows=update.count,
            bytes_read=self.storage.bytes_read - start_bytes,
            requests=self.storage.requests - start_requests,
            seconds=now - began,
            blocked_s=blocked,
            held_bytes=held,
            spilled_bytes=0 if update.spill is None else update.spill.bytes,
            lag_s=max(0.0, time.time() - plan.target.committed_at),
            cold=plan.cold,
            rewind=plan.rewind,
        )
        self.reports.append(report)
        return report.step

    def _read(self, manifest: Manifest, latest: Entry, asked: bool) -> PendingUpdate | None:
        """The update to ``latest``, read and ready; ``None`` if it is served already, or
        was refused and is not ``asked`` for by step."""
        if not asked and self.refused and self.refused[-1].checkpoint == latest.id:
            return None  # refused already: wait for the next commit
        chain = ChainReader(self.storage, manifest, latest, self._io, verify=False, lazy=True)
        slots = {
            key: (s.num_embeddings, s.embedding_dim) for key, s in self.target.tables().items()
        }
        check_serving(latest, slots, self.target.dense_names(), self.storage.url)
        served_id = None if self._served is None else self._served.id
        plan = plan_update(manifest, chain, self._served, served_id)
        if plan is None:
            return None
        update = PendingUpdate(plan, spill=self._spill_for(plan, latest))
        for table, shape in latest.tables.items():
            key = shape.state_dict_key
            wanted = None if plan.cold else plan.rows.get(table)
            if wanted is not None and not wanted.numel():
                continue
            if wanted is None and not plan.cold:
                continue
            parts: list[torch.Tensor | None] = [wanted]
            if update.spill is not None:
                assert self.memory_budget is not None
                every = torch.arange(shape.num_embeddings) if wanted is None else wanted
                parts = list(every.split(piece_rows(self.memory_budget, shape.embedding_dim)))
            for part in parts:
                if not self._take(update, key, _read_table(chain, table, part, plan.newer)):
                    return update  # a piece was refused
        if plan.dense or plan.cold:
            shapes, dense = self.target.tables(), self.target.dense_names()
            read = chain.dense([n for n in latest.dense if n in dense or n in shapes])
            for name, tensor in read.items():
                if name in shapes:  # a data-parallel table: replicated, saved with the dense
                    ids = torch.arange(tensor.shape[0])
                    if not self._take(update, name, [(ids, StoredRows.fp32(tensor))]):
                        return update
                else:
                    update.dense[name] = tensor
        return update

    def _spill_for(self, plan: UpdatePlan, latest: Entry) -> Spill | None:
        """A spill for an update whose rows would take more than the memory budget."""
        if self.memory_budget is None:
            return None
        need = 0
        for table, shape in latest.tables.items():
            wanted = plan.rows.get(table)
            rows = shape.num_embeddings if plan.cold or wanted is None else int(wanted.numel())
            need += rows * piece_bytes(shape.embedding_dim)
        return Spill(self.target, self.spill_dir) if need > self.memory_budget else None

    def _take(
        self, update: PendingUpdate, key: str, pieces: list[tuple[torch.Tensor, StoredRows]]
    ) -> bool:
        """Adds rows of ``key`` read together to ``update``: held in it, or, over the memory
        budget, shown to the gate as one piece and spilled; False if the gate refused it."""
        rows = [(key, ids, r) for ids, r in pieces]
        if update.spill is None:
            update.rows += rows
            return True
        if self.accept is not None:
            update.refused = self.accept(PendingUpdate(update.plan, rows))
            if update.refused is not None:
                return False
        update.spill.add(rows)
        return True

    def _apply(self, update: PendingUpdate) -> tuple[float, int]:
        """Writes what was read and names its step as served, both under the exclusive side
        of the lock: a lookup sees the rows of the step :attr:`step` names, never the rows
        of one step under the name of another. Returns how long serving was blocked, and
        the bytes the update's rows held."""
        if update.spill is not None:
            prepared, held = update.spill.pieces, update.spill.held_bytes
        else:
            prepared = [
                (key, ids, self.target.prepare(key, rows)) for key, ids, rows in update.rows
            ]
            held = memory_bytes(
                [ids for _, ids, _ in update.rows]
                + [t for _, _, rows in update.rows for t in rows.tensors()]
                + [t for _, _, rows in prepared for t in rows.tensors]
            )
        swap = self.target.swapping
        if swap:
            self._write_spare(prepared)
        with self._lock.exclusive():
            began = time.perf_counter()
            with torch.no_grad():
                if swap:
                    self.target.swap()
                else:
                    for key, ids, rows in prepared:
                        self.target.write_prepared(key, ids, rows)
                for name, tensor in update.dense.items():
                    self.target.write_dense(name, tensor)
            self._served = update.plan.target
            blocked = time.perf_counter() - began
        if swap:  # the spare (the copy served until now) lacks this update
            self._behind = prepared
            if update.plan.cold:
                self._behind = None  # every row: copied whole at the next update
        return blocked, held

    def _write_spare(self, prepared: list[tuple[str, torch.Tensor, PreparedRows]]) -> None:
        """Brings the spare copy to the served step, then writes the update into it."""
        behind, self._behind = self._behind, None  # unknown until written
        if behind is None:
            self.target.sync_spare()
            behind = []
        with torch.no_grad():
            for key, ids, rows in [*behind, *prepared]:
                self.target.write_prepared(key, ids, rows, spare=True)

    # -- background ---------------------------------------------------------

    def start(self, interval_s: float = 5.0) -> None:
        """Polls every ``interval_s`` on a thread until :meth:`stop`; a failed poll is
        logged and kept in :attr:`last_error`, and the next one tries again, after twice
        the wait of the one before while polls keep failing (at most 30 s, or the
        interval if longer)."""
        if self._thread is not None:
            raise CnrError("the follower is already polling")
        self._stop.clear()

        def run() -> None:
            failed = 0  # in a row: the wait doubles, up to 30 s (or the interval)
            while True:
                try:
                    self.poll()
                    self.last_error, failed = None, 0
                except Exception as e:  # keep serving the last good step
                    self.last_error, failed = e, failed + 1
                    self.failures += 1
                    logger.warning("follower of %s: update failed: %s", self.storage.url, e)
                wait = min(interval_s * 2 ** min(failed, 16), max(interval_s, 30.0))
                if self._stop.wait(wait):
                    return

        self._thread = threading.Thread(target=run, name="cnr-follower", daemon=True)
        self._thread.start()
        shutdown.register(self)

    def stop(self) -> None:
        """Stops polling, after the update in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        shutdown.unregister(self)

    stop_thread = stop

    def close(self) -> None:
        """Stops polling and the read threads."""
        self.stop()
        self._io.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
