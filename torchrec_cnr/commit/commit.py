"""Committing a written checkpoint: one manifest entry from every rank's report.

Check-N-Run (NSDI'22, Sec. 4.1): a checkpoint counts only once every rank's part is
durable; until then the previous checkpoint stays the one a restart uses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.retention import retire
from torchrec_cnr.encoding import FormatResolver, RankWrite, ShardWriter
from torchrec_cnr.errors import CheckpointError, wrapping
from torchrec_cnr.manifest import Entry, Keep, Manifest, saved_fraction
from torchrec_cnr.recovery.interval import IntervalDecision
from torchrec_cnr.schema import parse_checkpoint_id, without_gc
from torchrec_cnr.selection.policy import ChainState, Decision, Policy
from torchrec_cnr.snapshot import write_index
from torchrec_cnr.staging import RecordingSink, StagedCheckpoint
from torchrec_cnr.storage import PreconditionFailed, Storage

__all__ = [
    "Pending",
    "CommitTarget",
    "Landing",
    "append",
    "count_restore",
    "drop",
    "remove_failed",
    "write_and_commit",
    "write_rank",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitTarget:
    """Where and as whom a job commits."""

    storage: Storage
    policy: Policy
    generation: int
    """The writer generation the manifest must name (see ``commit.lease``)."""
    keep_last: int | None


@dataclass
class Pending:
    """A staged checkpoint on its way to storage."""

    seq: int
    staged: StagedCheckpoint | None
    """What staging copied; ``None`` if staging failed on this rank."""
    writer: ShardWriter | RecordingSink
    """Where staging handed the shards; it names the checkpoint directory. A recording
    sink with ``background="process"``: the writer process writes them."""
    decision: Decision
    chain: ChainState
    """The chain before this checkpoint."""
    resolver: FormatResolver
    interval_decision: IntervalDecision | None = None
    failure: Exception | None = None
    """Why staging failed on this rank, if it did: reported when every rank agrees."""


def write_rank(pending: Pending) -> tuple[RankWrite | None, Exception | None]:
    """This rank's part of ``pending`` encoded and written (no collective): its report, or
    why it failed, for :func:`write_and_commit`."""
    try:
        if pending.failure is not None:
            raise pending.failure
        assert pending.staged is not None
        if isinstance(pending.writer, RecordingSink):
            raise TypeError("a recorded checkpoint is written by the writer process")
        return pending.writer.finish(pending.staged), None
    except Exception as e:  # every rank must learn of it before anyone commits
        return None, e


def write_and_commit(
    pending: Pending,
    group: Collective,
    target: CommitTarget,
    written: tuple[RankWrite | None, Exception | None] | None = None,
    hook: Landing | None = None,
) -> ChainState:
    """Encodes, writes, agrees and commits one checkpoint; returns the chain it ends.

    Runs on every rank's background writer, collectively over ``group``. If anything
    fails, the checkpoint's files are removed at once (see :func:`remove_failed`).

    Args:
        written: this rank's :func:`write_rank`, if it ran already.
        hook: what a plug-in changes of the manifest, for :func:`append` (rank 0's).

    Raises:
        CheckpointError: writing failed on some rank, or another job took the root over;
            nothing was committed.
    """
    ckpt_id = pending.writer.ckpt_id
    write, error = written if written is not None else write_rank(pending)
    try:
        group.agree(error)
    except Exception as e:
        # A job that took the root over removes what older writers left uncommitted, this
        # checkpoint's files among them: that is the reason to give, and nothing is deleted.
        group.on_rank0(lambda: _refuse_if_taken_over(target))
        _remove_on_rank0(group, target, ckpt_id)
        raise wrapping(CheckpointError(f"writing failed: {e}"), e) from e
    staged = pending.staged
    assert staged is not None
    # Only rank 0 commits: only it receives (and holds) every rank's shard records.
    with without_gc():
        gathered = group.gather_on_rank0(write)

    def commit() -> float:
        assert gathered is not None
        writes = [w for w in gathered if w is not None]
        size = saved_fraction([r for w in writes for r in w.shards])
        chain = target.policy.advance(pending.chain, pending.decision, ckpt_id, size)
        try:
            entry = _entry(ckpt_id, pending, staged, chain, writes, target)
            # IMPORTANT: every rank's part is durable: the index goes last, then the manifest.
            write_index(target.storage, ckpt_id, [w.index for w in writes], len(writes))
            entry = dataclasses.replace(entry, bytes=target.storage.tree_bytes(ckpt_id))
            append(target, entry, hook)
        except Exception:
            remove_failed(target, ckpt_id)
            raise
        return size

    with without_gc():
        size = group.on_rank0(commit)
    # Every rank advances its own chain (sending it would cost as much as the chain is long).
    logger.info("checkpoint %s committed (%s)", ckpt_id, staged.kind)
    return target.policy.advance(pending.chain, pending.decision, ckpt_id, size)


def _refuse_if_taken_over(target: CommitTarget) -> None:
    try:
        found = Manifest.load(target.storage).writer_generation
    except Exception:  # unreadable: the write's own failure is the one to report
        return
    if found > target.generation:  # a newer writer (a root gone would read as 0)
        raise _stale(target.storage, target.generation, found)


def _remove_on_rank0(group: Collective, target: CommitTarget, ckpt_id: str) -> None:
    # Every rank agreed that the write failed, so none writes into the directory any more.
    if group.rank == 0:
        remove_failed(target, ckpt_id)


def remove_failed(target: CommitTarget, ckpt_id: str, dropped: str | None = None) -> bool:
    """Deletes the files of this writer's checkpoint ``ckpt_id`` that failed to commit, or
    that it dropped (``dropped`` says why, for the log), so that a full disk gets its space
    back at once (rank 0 only).

    Nothing is deleted unless the root's manifest can be read and does not name it: a
    commit that failed after its manifest was written leaves a committed checkpoint.
    A crash that leaves such files is cleaned up by the next writer's first commit.

    Returns:
        Whether the files were deleted.
    """
    try:
        if Manifest.load(target.storage).find_id(ckpt_id) is not None:
            return False
        target.storage.delete_tree(ckpt_id)
    except Exception as e:  # the root is unreadable now: the next commit cleans it up
        logger.warning("could not remove the files of %s: %s", ckpt_id, e)
        return False
    if dropped is None:
        logger.warning("removed the files of the failed checkpoint %s", ckpt_id)
    else:
        logger.info("dropped %s (%s) and removed its files", ckpt_id, dropped)
    return True


def _entry(
    ckpt_id: str,
    pending: Pending,
    staged: StagedCheckpoint,
    chain: ChainState,
    writes: list[RankWrite],
    target: CommitTarget,
) -> Entry:
    differ = sorted(
        name
        for w in writes[1:]
        for name, crc in w.dense_checksums.items()
        if writes[0].dense_checksums.get(name) != crc
    )
    if differ:
        # Replicated tensors are written once, by rank 0: replicas that drifted apart
        # would make a checkpoint that matches no rank.
        raise CheckpointError(
            f"dense tensors {differ} differ between ranks; replicated state (DDP parameters, "
            "data-parallel tables) must be identical on every rank"
        )
    shards = [rec for w in writes for rec in w.shards]
    tables, dense_info = Entry.signature([s.spec for s in shards], staged.dense)
    return Entry(
        id=ckpt_id,
        seq=pending.seq,
        step=staged.step,
        kind=staged.kind,
        policy=target.policy.name,
        chain=list(chain.chain),
        sizes=list(chain.sizes),
        world_size=len(writes),
        tables=tables,
        dense=dense_info,
        shards=shards,
        dense_checksums=writes[0].dense_checksums,
        app_checksums=[w.app_checksum for w in writes],
        bytes=0,  # set once the index is written
        saved_at=staged.saved_at,
        restores_before=pending.resolver.restores,
        staged_bytes=writes[0].staged_bytes,
        stall_s=max(w.stall_s for w in writes),
        interval_decision=pending.interval_decision,
        since=pending.chain.chain[-1] if pending.chain.chain else None,
        shard_parts={str(rank): w.part_checksum for rank, w in enumerate(writes)},
    )


def _stale(storage: Storage, generation: int, found: int) -> CheckpointError:
    from torchrec_cnr.commit.lease import read_lease

    holder = read_lease(storage)[0]
    who = holder.describe() if holder is not None else f"generation {found}"
    return CheckpointError(
        f"{storage.url} was taken over: {who} writes it now, so this job's generation "
        f"{generation} may not commit; this checkpoint is dropped and nothing was deleted"
    )


class Landing(Protocol):
    """What a plug-in of the commit (a compaction landing with it) changes of the manifest
    (rank 0, in :func:`append`)."""

    def land(self, manifest: Manifest) -> None:
        """Changes ``manifest`` before the checkpoint is added to it."""
        ...

    def keep(self) -> Keep | None:
        """What the manifest's sealing and retention must keep."""
        ...


def append(target: CommitTarget, entry: Entry, hook: Landing | None = None) -> Manifest:
    """Commits ``entry`` (its record, then the root's manifest), then applies retention
    (rank 0 only), with what ``hook`` changes of the manifest and keeps of it.

    IMPORTANT: call this only after every rank reported its files durable; the
    manifest's rename (or PUT) is what makes the checkpoint exist.

    Raises:
        CheckpointError: another job took the root over (a newer generation): nothing
            was committed and nothing deleted.
    """
    storage, generation = target.storage, target.generation
    manifest = Manifest.load(storage)
    if manifest.writer_generation != generation:
        raise _stale(storage, generation, manifest.writer_generation)
    previous = manifest.latest()
    keep = None
    if hook is not None:
        hook.land(manifest)
        keep = hook.keep()
    manifest.add(entry)
    try:
        manifest.save(storage, keep.seq if keep is not None else None)
    except PreconditionFailed as e:
        raise _stale(storage, generation, Manifest.load(storage).writer_generation) from e
    # A writer's first commit also removes what older writers left uncommitted.
    named = None if previous is None else parse_checkpoint_id(previous.id)
    first = named is None or named.generation != generation
    try:
        retire(storage, manifest, target.keep_last, generation, sweep=first, keep=keep)
    except PreconditionFailed:
        # Committed; another job took the root over before retention rewrote the
        # manifest. Nothing is retired or deleted, and the next save is refused.
        logger.warning(
            "%s: checkpoint %s is committed, but another writer changed the manifest "
            "before old checkpoints were retired; they stay",
            storage.url,
            entry.id,
        )
    except Exception as e:  # committed all the same: the save must not report a failure
        logger.warning(
            "%s: checkpoint %s is committed, but retiring old checkpoints failed (%s: %s); "
            "those the manifest still names are retired by the next commit, files it no "
            "longer names stay until the root's next writer sweeps it",
            storage.url,
            entry.id,
            type(e).__name__,
            e,
        )
    return manifest


def count_restore(storage: Storage, generation: int) -> int:
    """Adds one to the root's restore count (rank 0 of the root's writer); returns it."""
    manifest = Manifest.load(storage)
    if manifest.writer_generation != generation:
        raise _stale(storage, generation, manifest.writer_generation)
    manifest.restores += 1
    manifest.save(storage)
    return manifest.restores


def drop(target: CommitTarget, ids: Collection[str]) -> list[str]:
    """Retires the committed checkpoints ``ids`` and every one whose chain holds one of
    them (rank 0 of the root's writer): the manifest forgets them first, then their files
    go. Returns the ids retired, oldest first.

    Raises:
        CheckpointError: another job took the root over: nothing was changed.
    """
    storage, generation = target.storage, target.generation
    manifest = Manifest.load(storage)
    if manifest.writer_generation != generation:
        raise _stale(storage, generation, manifest.writer_generation)
    doomed = set(ids)
    for entry in manifest.checkpoints:  # oldest first: a chain is its parent's and itself
        if entry.parent in doomed:
            doomed.add(entry.id)
    retired = [e.id for e in manifest.checkpoints if e.id in doomed]
    if not retired:
        return []
    manifest.checkpoints = [e for e in manifest.checkpoints if e.id not in doomed]
    try:
        manifest.save(storage)
    except PreconditionFailed as e:
        raise _stale(storage, generation, Manifest.load(storage).writer_generation) from e
    for ckpt_id in retired:
        storage.delete_tree(ckpt_id)
    return retired
