"""Compaction off the commit path (``CheckpointConfig(compact_every=N)``): no save waits
for it.

Once a chain holds N deltas, the commit job that made it starts compacting its latest
checkpoint C on a thread of its own, at the lowest CPU priority and with I/O threads of
its own (:class:`BackgroundCompaction`), and returns: later checkpoints go on committing
while it reads C's chain and writes one full checkpoint F of C's step. The first commit
job after every rank has written its part *lands* F: F is committed in the same manifest
write as that job's own checkpoint, right after C (the same step, ``compacted_from`` C: a
restore of that step reads F), the checkpoints committed since C link to F instead of C
(:meth:`~torchrec_cnr.manifest.store.Manifest.land`), and that job's checkpoint, and every
later one, continues the chain from F (:func:`rebase`): ``keep_last`` retires C's chain as
it would any other. Until it lands, the manifest keeps C's chain (retention) and the
checkpoints from C on out of the sealed history
(:class:`~torchrec_cnr.manifest.store.Keep`). :class:`CompactionHook` plugs all this into
the save's commit job (:func:`~torchrec_cnr.commit.job.commit_job`).

A compaction that failed on some rank is reported after the job's own checkpoint, which
is committed as usual; one whose chain the job has left (it restored another checkpoint)
is dropped. Either way its files go at once. At ``close()``, and before an explicit
``compact()``, a compaction in flight is finished: committed if C is still the latest
checkpoint (as an explicit compaction is), dropped otherwise (:meth:`BackgroundCompaction.finish`).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import CommitTarget, Pending, append, remove_failed
from torchrec_cnr.commit.background import JobResult
from torchrec_cnr.compaction.compact import CompactedPart, compact_part, compacted_entry
from torchrec_cnr.iocontext import IOContext, lowered_priority
from torchrec_cnr.manifest import Entry, Keep, Manifest
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.selection import ChainState
from torchrec_cnr.snapshot import checkpoint_id

__all__ = [
    "BackgroundCompaction",
    "CompactionHook",
    "Landing",
    "compact",
    "compaction_job",
    "finishing_job",
    "rebase",
]

NICE = 19
"""How much lower than the writer's the compaction's threads run: they take what the
cores leave."""


DROPPED_LATER = "a compaction of a checkpoint that is no longer the latest"
DROPPED_LEFT = "a compaction of a chain the job left: it restored another checkpoint"


def rebase(chain: ChainState, compacted: str, new_id: str) -> ChainState | None:
    """``chain`` with its links up to ``compacted`` replaced by ``new_id``, their
    compaction; ``None`` if ``chain`` does not pass through ``compacted``."""
    if compacted not in chain.chain:
        return None
    after = chain.chain[chain.chain.index(compacted) + 1 :]
    return ChainState([new_id, *after], list(chain.sizes))


@dataclass(frozen=True)
class Landing:
    """A compaction every rank has written, ready to commit."""

    compacted: str
    """C, the checkpoint it compacts."""
    new_id: str
    """F, its directory."""
    entry: Entry | None
    """F's entry, its index written (rank 0's; ``None`` elsewhere)."""


@dataclass
class _Running:
    reader: ChainReader
    new_id: str
    io: IOContext
    rank: int
    world: int
    nice: int
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    part: CompactedPart | None = None
    error: Exception | None = None
    thread: threading.Thread | None = None

    @property
    def compacted(self) -> Entry:
        return self.reader.entry

    def run(self) -> None:
        lower = lowered_priority(self.nice)
        if lower is not None:
            lower()
        try:
            self.part = compact_part(
                self.reader, self.new_id, self.rank, self.world, self.io, self.stop
            )
        except Exception as e:  # reported once every rank has ended
            self.error = e


class BackgroundCompaction:
    """The compaction in flight on one rank's writer, if any. :meth:`start`, :meth:`land`
    and :meth:`finish` run in background jobs, collectively: every rank starts, lands and
    finishes it in the same job."""

    def __init__(self) -> None:
        self._running: _Running | None = None

    @property
    def keep(self) -> Keep | None:
        """What the compaction in flight keeps of the manifest."""
        r = self._running
        return (
            None
            if r is None
            else Keep(r.compacted.seq, frozenset(link.id for link in r.reader.links))
        )

    def start(
        self,
        group: Collective,
        target: CommitTarget,
        io: IOContext,
        chain: ChainState,
        every: int | None,
    ) -> None:
        """Starts compacting the checkpoint ``chain`` ends at, if it holds at least ``every``
        deltas and no compaction runs; returns at once."""
        if every is None or self._running is not None or len(chain.chain) - 1 < max(every, 1):
            return
        if target.policy.name != "consecutive":  # a baseline and a delta at most (config warns)
            return
        self._begin(group, target, io, NICE, chain.chain[-1])

    def _begin(
        self,
        group: Collective,
        target: CommitTarget,
        io: IOContext,
        nice: int,
        latest_id: str | None,
    ) -> bool:
        """Starts compacting the root's latest checkpoint (if it is ``latest_id``, where
        given), ``nice`` lower than ``io``'s threads; whether it did."""
        storage = target.storage
        manifest = group.on_rank0(lambda: Manifest.load(storage)).attach(storage)
        latest = manifest.latest()
        if latest is None or latest.depth == 1 or latest_id not in (None, latest.id):
            return False
        new_id = checkpoint_id(latest.seq, latest.step, target.generation, compacted=True)
        own = IOContext(dataclasses.replace(io.options, nice=min(19, io.options.nice + nice)))
        reader = ChainReader(storage, manifest, latest, own, lazy=True)
        r = _Running(reader, new_id, own, group.rank, group.world_size, nice)
        r.thread = threading.Thread(target=r.run, name="cnr-compaction", daemon=True)
        self._running = r
        r.thread.start()
        return True

    def land(
        self, group: Collective, target: CommitTarget
    ) -> tuple[Landing | None, Exception | None]:
        """The compaction in flight once every rank has written its part: its landing, or
        its failure (every rank's, agreed; its files removed). ``(None, None)`` while some
        rank still writes, or if none runs."""
        r = self._running
        if r is None or group.any(r.thread is not None and r.thread.is_alive()):
            return None, None
        return self._end(group, target)

    def finish(self, group: Collective, target: CommitTarget) -> ChainState | None:
        """Waits for the compaction in flight and commits it if the checkpoint it compacts
        is still the latest; else drops it. Returns the chain it leaves (F alone), or
        ``None`` if it committed nothing.

        Raises:
            Exception: the compaction failed on some rank (agreed); its files are removed.
        """
        if self._running is None:
            return None
        landing, error = self._end(group, target)
        if error is not None:
            raise error
        assert landing is not None

        def commit() -> bool:
            latest = Manifest.load(target.storage).latest()
            if latest is None or latest.id != landing.compacted:
                remove_failed(target, landing.new_id, DROPPED_LATER)
                return False
            assert landing.entry is not None
            append(target, landing.entry)
            return True

        return ChainState([landing.new_id], []) if group.on_rank0(commit) else None

    def stop(self) -> None:
        """Stops the compaction in flight on this rank, without the others: its files stay
        until the next writer's first commit removes them, as a crash's."""
        r, self._running = self._running, None
        if r is not None:
            r.stop.set()
            if r.thread is not None:
                r.thread.join()
            r.io.close()

    def _end(
        self, group: Collective, target: CommitTarget
    ) -> tuple[Landing | None, Exception | None]:
        r, self._running = self._running, None
        assert r is not None and r.thread is not None
        r.thread.join()
        r.io.close()
        entry: list[Entry] = []
        try:
            group.agree(r.error)
            parts = group.gather_on_rank0(r.part)

            def index() -> None:
                assert parts is not None
                written = [p for p in parts if p is not None]
                entry.append(compacted_entry(r.reader, r.new_id, written))

            group.on_rank0(index)
        except Exception as e:
            if group.rank == 0:  # every rank's part has ended
                remove_failed(target, r.new_id)
            return None, e
        return Landing(r.compacted.id, r.new_id, entry[0] if entry else None), None


def compact(group: Collective, target: CommitTarget, io: IOContext) -> ChainState | None:
    """Compacts the chain of the latest committed checkpoint, collectively over ``group``,
    and commits it: each rank merges the shards its storage rank saved, rank 0 also
    copies the dense state and every rank's ``app_state``, writes the index and commits.

    Returns:
        The chain state after it (the compacted checkpoint alone), or ``None`` if there
        was nothing to compact.

    Raises:
        CheckpointError: another job took the root over; nothing was committed.
        CheckpointReadError: the chain is damaged; nothing was committed.
    """
    now = BackgroundCompaction()
    if not now._begin(group, target, io, 0, None):
        return None
    return now.finish(group, target)


@dataclass
class CompactionHook:
    """Compaction in one save's commit job (a :class:`~torchrec_cnr.commit.job.CommitHook`):
    lands the compaction in flight with the checkpoint once every rank has written its
    part, keeps what it reads until then, and starts the next once the chain holds
    ``every`` deltas (``CheckpointConfig.compact_every``; never if ``None``). A failed
    compaction leaves the committed checkpoint as it is, and is reported."""

    compaction: BackgroundCompaction
    io: IOContext
    every: int | None
    landing: Landing | None = None
    """The compaction this job lands, once :meth:`before_commit` found every rank done."""
    error: Exception | None = None
    """The compaction's failure, reported after the commit."""

    def before_commit(self, pending: Pending, group: Collective, target: CommitTarget) -> Pending:
        landing, self.error = self.compaction.land(group, target)
        if landing is None:
            return pending
        rebased = rebase(pending.chain, landing.compacted, landing.new_id)
        if rebased is None:  # the job restored another checkpoint since it started
            if group.rank == 0:
                remove_failed(target, landing.new_id, DROPPED_LEFT)
            return pending
        self.landing = landing
        return dataclasses.replace(pending, chain=rebased)

    def land(self, manifest: Manifest) -> None:
        if self.landing is not None and self.landing.entry is not None:
            manifest.land(self.landing.entry)

    def keep(self) -> Keep | None:
        return self.compaction.keep

    def commit_failed(self, group: Collective, target: CommitTarget) -> None:
        if self.landing is not None and group.rank == 0:  # unless the manifest names it
            remove_failed(target, self.landing.new_id)

    def after_commit(
        self, group: Collective, target: CommitTarget, chain: ChainState
    ) -> Exception | None:
        try:
            self.compaction.start(group, target, self.io, chain, self.every)
        except Exception as e:  # the checkpoint itself is committed
            return self.error or e
        return self.error


def compaction_job(
    target: CommitTarget,
    io: IOContext,
    chain: ChainState,
    what: str,
    group: Collective,
    compaction: BackgroundCompaction,
) -> JobResult:
    """A background job: finishes the compaction in flight, then compacts the latest chain
    (see :func:`compact`); ``chain`` is the chain state it leaves if there is nothing to
    compact."""
    chain = compaction.finish(group, target) or chain
    return JobResult(compact(group, target, io) or chain, what)


def finishing_job(
    target: CommitTarget, chain: ChainState, what: str, group: Collective,
    compaction: BackgroundCompaction,
) -> JobResult:  # fmt: skip
    """A background job at ``close()``: finishes the compaction in flight (see
    :meth:`BackgroundCompaction.finish`)."""
    return JobResult(compaction.finish(group, target) or chain, what)
