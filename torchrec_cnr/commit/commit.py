"""Committing a written checkpoint: one manifest entry from every rank's report.

Check-N-Run (NSDI'22, Sec. 4.1): a checkpoint counts only once every rank's part is
durable; until then the previous checkpoint stays the one a restart uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.manifest import Entry, Manifest, saved_fraction
from torchrec_cnr.commit.retention import retire
from torchrec_cnr.encoding import FormatResolver
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.selection.policy import ChainState, Decision, Policy
from torchrec_cnr.staging import StagedCheckpoint
from torchrec_cnr.storage import PreconditionFailed, RankWrite, ShardWriter, Storage, write_index

__all__ = ["Pending", "Target", "append", "count_restore", "write_and_commit"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
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
    staged: StagedCheckpoint
    writer: ShardWriter
    """Where staging handed the shards; it names the checkpoint directory."""
    decision: Decision
    chain: ChainState
    """The chain before this checkpoint."""
    resolver: FormatResolver
    interval_decision: dict[str, Any] | None = None
    failure: Exception | None = None
    """Why staging failed on this rank, if it did: reported when every rank agrees."""


def write_and_commit(pending: Pending, group: Collective, target: Target) -> ChainState:
    """Encodes, writes, agrees and commits one checkpoint; returns the chain it ends.

    Runs on every rank's background writer, collectively over ``group``.

    Raises:
        CheckpointError: writing failed on some rank, or another job took the root over;
            nothing was committed.
    """
    staged = pending.staged
    ckpt_id = pending.writer.ckpt_id
    error: BaseException | None = None
    write = None
    try:
        if pending.failure is not None:
            raise pending.failure
        write = pending.writer.finish(staged)
    except Exception as e:  # every rank must learn of it before anyone commits
        error = e
    try:
        group.agree(error)
    except Exception as e:
        raise CheckpointError(f"writing failed: {e}") from e
    writes = [w for w in group.gather(write) if w is not None]
    size = saved_fraction([r for w in writes for r in w.shards])
    chain = target.policy.advance(pending.chain, pending.decision, ckpt_id, size)
    error = None
    if group.rank == 0:
        try:
            entry = _entry(ckpt_id, pending, chain, writes, target)
            # Every rank's part is durable: the index goes last, then the manifest.
            write_index(target.storage, ckpt_id, [w.entries for w in writes], len(writes))
            entry.bytes = target.storage.tree_bytes(ckpt_id)
            append(target, entry)
        except Exception as e:
            error = e
    group.agree(error)
    logger.info("checkpoint %s committed (%s)", ckpt_id, staged.kind)
    return chain


def _entry(
    ckpt_id: str, pending: Pending, chain: ChainState, writes: list[RankWrite], target: Target
) -> Entry:
    staged = pending.staged
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
        restores_before=pending.resolver.restores,
        staged_bytes=writes[0].staged_bytes,
        stall_s=max(w.stall_s for w in writes),
        interval_decision=pending.interval_decision,
    )


def _stale(storage: Storage, generation: int, found: int) -> CheckpointError:
    from torchrec_cnr.commit.lease import Lease

    holder = Lease(storage, take_over=False, fallback=False).holder()
    who = holder.describe() if holder is not None else f"generation {found}"
    return CheckpointError(
        f"{storage.url} was taken over: {who} writes it now, so this job's generation "
        f"{generation} may not commit; this checkpoint is dropped and nothing was deleted"
    )


def append(target: Target, entry: Entry) -> Manifest:
    """Commits ``entry`` to the root's manifest, then applies retention (rank 0 only).

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
    manifest.checkpoints.append(entry)
    try:
        manifest.save(storage)
    except PreconditionFailed as e:
        raise _stale(storage, generation, Manifest.load(storage).writer_generation) from e
    retire(storage, manifest, target.keep_last, generation)
    return manifest


def count_restore(storage: Storage, generation: int) -> int:
    """Adds one to the root's restore count (rank 0 of the root's writer); returns it."""
    manifest = Manifest.load(storage)
    if manifest.writer_generation != generation:
        raise _stale(storage, generation, manifest.writer_generation)
    manifest.restores += 1
    manifest.save(storage)
    return manifest.restores
