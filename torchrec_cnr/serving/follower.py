"""A follower: keeps a serving model at the latest committed checkpoint of a root.

Check-N-Run names "publishing snapshots in real time" among the reasons to checkpoint:
serving wants fresh embeddings. Each update of a :class:`Follower`

1. reads the root's manifest (only committed checkpoints exist there);
2. plans which rows changed since the served checkpoint (:mod:`.plan`);
3. reads only those rows' latest versions from the target's chain, newest link first,
   each row once, with ranged reads of consecutive rows (a ranged GET on S3);
4. applies them, with the dense state if it changed, to the serving model under the
   exclusive side of a lock whose shared side serving code takes around its forwards
   (:meth:`Follower.serving`): a lookup sees one committed step, never a mix of two.

Everything that can fail (a file retired by ``keep_last`` or replaced by compaction
while read, a damaged or missing file, a model that does not match) fails before the
model changes: the follower keeps serving the last good step and tries again at the next
poll, re-planning from the manifest as it is then.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.commit.manifest import Entry, Manifest
from torchrec_cnr.encoding import FP32, ShardRecord
from torchrec_cnr.errors import CheckpointReadError, CnrError, ModelMismatchError
from torchrec_cnr.restore.chain import ChainReader
from torchrec_cnr.serving.plan import UpdatePlan, plan_update
from torchrec_cnr.serving.rows import StoredRows
from torchrec_cnr.serving.targets import Target
from torchrec_cnr.storage import Root, Storage, as_storage
from torchrec_cnr.storage.backend import ANY, _Any

__all__ = ["Follower", "UpdateReport"]

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


class _CountingStorage(Storage):
    """Passes every operation through and counts the bytes read."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def path(self, name: str) -> str:
        return self.inner.path(name)

    def read(self, name: str) -> tuple[bytes, str] | None:
        got = self.inner.read(name)
        self._count(0 if got is None else len(got[0]))
        return got

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(name, offset, out)
        self._count(len(out))

    def write(self, name: str, data: bytes, expect: str | None | _Any = ANY) -> str:
        raise CnrError(f"a follower never writes ({self.inner.path(name)})")

    def write_object(self, name: str, data: memoryview) -> None:
        raise CnrError(f"a follower never writes ({self.inner.path(name)})")

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def children(self) -> list[str]:
        return self.inner.children()

    def delete(self, name: str) -> None:
        raise CnrError(f"a follower never deletes ({self.inner.path(name)})")

    def delete_tree(self, name: str) -> None:
        raise CnrError(f"a follower never deletes ({self.inner.path(name)})")

    def clear(self) -> None:
        raise CnrError("a follower never deletes")

    def tree_bytes(self, name: str) -> int:
        return self.inner.tree_bytes(name)

    def make_durable(self, name: str) -> None:
        raise CnrError("a follower never writes")


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


@dataclass
class _Update:
    """Everything read for one update, ready to apply."""

    plan: UpdatePlan
    rows: list[tuple[str, torch.Tensor, StoredRows]] = field(default_factory=list)
    """(state-dict key, ``(k,)`` ascending global ids, their rows)."""
    dense: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(int(ids.numel()) for _, ids, _ in self.rows)


def _stored(chain: ChainReader, n: int, rec: ShardRecord, keep: torch.Tensor) -> StoredRows:
    """Rows ``keep`` (positions) of a saved shard, as stored."""
    if rec.format == FP32:
        return StoredRows.fp32(chain.subset(n, rec, rec.weight_name(rec.key), keep))
    parts = {p: chain.subset(n, rec, rec.part_name(rec.key, p), keep) for p in rec.parts}
    return StoredRows.quantized(parts, rec.format.method, rec.format.bits, rec.spec.cols)


def _read_table(
    chain: ChainReader, table: str, wanted: torch.Tensor | None
) -> list[tuple[torch.Tensor, StoredRows]]:
    """The latest stored version of rows ``wanted`` (every row if ``None``) of ``table``
    in ``chain``, newest link first, each row read once: ``(ids, rows)`` pieces."""
    shape = chain.entry.tables[table]
    remaining = torch.arange(shape.num_embeddings) if wanted is None else wanted
    full_width = all(rec.spec.cols == shape.embedding_dim for _, rec in chain.records(table))
    if not full_width:
        return [(remaining, StoredRows.fp32(_assemble(chain, table, remaining)))]
    pieces = []
    for n in reversed(range(len(chain.links))):
        for rec in chain.links[n].shards:
            if rec.spec.table != table or rec.saved_rows == 0 or not remaining.numel():
                continue
            saved = chain.saved_ids(n, rec)
            at = torch.searchsorted(saved, remaining).clamp_max(saved.numel() - 1)
            hit = saved[at] == remaining
            if not bool(hit.any()):
                continue
            keep = at[hit]
            pieces.append((remaining[hit], _stored(chain, n, rec, keep)))
            remaining = remaining[~hit]
    return pieces


def _assemble(chain: ChainReader, table: str, ids: torch.Tensor) -> torch.Tensor:
    """Full fp32 rows of a table whose rows are split by column (or resharded)."""
    from torchrec_cnr.offline.tables import table_values

    return table_values(chain, table, ids)


class Follower:
    """Keeps ``target`` at the latest committed checkpoint of ``root``.

    Read-only: any number of followers on any number of hosts follow one root without a
    lease, and a writer's commits see only their reads.

    Args:
        root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        target: the serving model, wrapped (:class:`~torchrec_cnr.serving.FloatTarget`
            for the unsharded fp32 model, :class:`~torchrec_cnr.serving.QuantizedTarget`
            for TorchRec's quantized inference model).
        io_threads: threads that read at once.
        piece_kb: the most one read request reads, in KiB.

    Example::

        follower = Follower("/ckpt/run1", QuantizedTarget(quantize_embeddings(model)))
        follower.poll()                       # the latest committed step, now
        follower.start(interval_s=5.0)        # and every 5 s, on a thread
        with follower.serving():              # forwards see one committed step
            scores = model(batch)
        follower.stop()
    """

    def __init__(
        self, root: Root, target: Target, io_threads: int = 8, piece_kb: int = 64 << 10
    ) -> None:
        self.storage = _CountingStorage(as_storage(root))
        self.target = target
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="cnr-follow")
        self._piece_bytes = piece_kb << 10
        self._lock = _SharedLock()
        self._served: Entry | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.reports: list[UpdateReport] = []
        """Every update applied, oldest first."""
        self.last_error: Exception | None = None
        """Why the last poll failed, if it did (the last good step stays served)."""

    @property
    def step(self) -> int | None:
        """The step served; ``None`` before the first update."""
        return None if self._served is None else self._served.step

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Hold this around each forward: updates wait for it, and it waits for them."""
        return self._lock.shared()

    def poll(self) -> int | None:
        """Applies whatever was committed since the served checkpoint; returns the step
        served after it (``None`` while the root holds no checkpoint).

        Raises:
            ModelMismatchError: the checkpoint's tables or dense tensors do not match the
                serving model; nothing changed.
            CheckpointReadError, ManifestError: a file is missing or damaged; nothing
                changed, and the last good step stays served.
        """
        began = time.perf_counter()
        start_bytes = self.storage.bytes_read
        for attempt in range(3):
            manifest = Manifest.load(self.storage)
            latest = manifest.latest()
            if latest is None:
                return self.step
            try:
                update = self._read(manifest, latest)
                break
            except CheckpointReadError:
                # Retired by keep_last or replaced by compaction while read: re-plan.
                if attempt == 2 or Manifest.load(self.storage).find_id(latest.id) == latest:
                    raise
                logger.info("checkpoint %s changed while read; planning again", latest.id)
        if update is None:
            return self.step
        blocked = self._apply(update)
        plan = update.plan
        if plan.rewind:
            logger.warning(
                "%s went back to step %d (it served step %d): the job restored an older "
                "checkpoint; following the root's latest",
                self.storage.url,
                plan.target.step,
                self.step,
            )
        self._served = plan.target
        now = time.perf_counter()
        report = UpdateReport(
            step=plan.target.step,
            checkpoint=plan.target.id,
            rows=update.count,
            bytes_read=self.storage.bytes_read - start_bytes,
            seconds=now - began,
            blocked_s=blocked,
            lag_s=max(0.0, time.time() - plan.target.committed_at),
            cold=plan.cold,
            rewind=plan.rewind,
        )
        self.reports.append(report)
        return report.step

    def _read(self, manifest: Manifest, latest: Entry) -> _Update | None:
        chain = ChainReader(
            self.storage, manifest, latest, self._executor, self._piece_bytes, verify=False
        )
        self._check(latest)
        served_id = None if self._served is None else self._served.id
        plan = plan_update(manifest, chain, self._served, served_id)
        if plan is None:
            return None
        update = _Update(plan)
        for table, shape in latest.tables.items():
            key = shape.state_dict_key
            wanted = None if plan.cold else plan.rows.get(table)
            if wanted is not None and not wanted.numel():
                continue
            if wanted is None and not plan.cold:
                continue
            for ids, rows in _read_table(chain, table, wanted):
                update.rows.append((key, ids, rows))
        if plan.dense or plan.cold:
            slots, dense = self.target.tables(), self.target.dense_names()
            read = chain.dense([n for n in latest.dense if n in dense or n in slots])
            for name, tensor in read.items():
                if name in slots:  # a data-parallel table: replicated, saved with the dense
                    ids = torch.arange(tensor.shape[0])
                    update.rows.append((name, ids, StoredRows.fp32(tensor)))
                else:
                    update.dense[name] = tensor
        return update

    def _check(self, entry: Entry) -> None:
        """Raises :class:`ModelMismatchError` naming every difference, before any change."""
        slots = self.target.tables()
        problems = []
        for name, shape in entry.tables.items():
            key = shape.state_dict_key
            slot = slots.get(key)
            if not key:
                problems.append(
                    f"table {name!r}: the checkpoint records no state-dict key (format < 3)"
                )
            elif slot is None:
                problems.append(f"table {name!r} ({key}) is in the checkpoint but not in the model")
            elif (slot.num_embeddings, slot.embedding_dim) != (
                shape.num_embeddings,
                shape.embedding_dim,
            ):
                problems.append(
                    f"table {key} is {shape.num_embeddings}x{shape.embedding_dim} in the "
                    f"checkpoint but {slot.num_embeddings}x{slot.embedding_dim} in the model"
                )
        # Data-parallel tables are replicated and travel with the dense state.
        known = {s.state_dict_key for s in entry.tables.values()} | set(entry.dense)
        problems += [
            f"table {key} is in the model but not in the checkpoint"
            for key in sorted(set(slots) - known)
        ]
        dense = self.target.dense_names()
        problems += [
            f"dense tensor {name!r} is in the model but not in the checkpoint"
            for name in sorted(set(dense) - set(entry.dense))
        ]
        for name in sorted(set(dense) & set(entry.dense)):
            want = tuple(entry.dense[name].shape)
            got = tuple(dense[name])
            if want != got:
                problems.append(
                    f"dense tensor {name!r} is {list(want)} in the checkpoint but {list(got)} in the model"
                )
        if problems:
            raise ModelMismatchError(
                f"checkpoint of step {entry.step} in {self.storage.url} does not match the "
                "serving model:\n  " + "\n  ".join(problems)
            )

    def _apply(self, update: _Update) -> float:
        """Writes what was read; returns how long serving was blocked."""
        prepared = [(key, ids, self.target.prepare(key, rows)) for key, ids, rows in update.rows]
        with self._lock.exclusive():
            began = time.perf_counter()
            with torch.no_grad():
                for key, ids, rows in prepared:
                    self.target.write_prepared(key, ids, rows)
                for name, tensor in update.dense.items():
                    self.target.write_dense(name, tensor)
            return time.perf_counter() - began

    # -- background ---------------------------------------------------------

    def start(self, interval_s: float = 5.0) -> None:
        """Polls every ``interval_s`` on a thread until :meth:`stop`; a failed poll is
        logged and kept in :attr:`last_error`, and the next one tries again."""
        if self._thread is not None:
            raise CnrError("the follower is already polling")
        self._stop.clear()

        def run() -> None:
            while True:
                try:
                    self.poll()
                    self.last_error = None
                except Exception as e:  # keep serving the last good step
                    self.last_error = e
                    logger.warning("follower of %s: update failed: %s", self.storage.url, e)
                if self._stop.wait(interval_s):
                    return

        self._thread = threading.Thread(target=run, name="cnr-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops polling (after the update in flight) and releases the read threads."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._executor.shutdown()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
