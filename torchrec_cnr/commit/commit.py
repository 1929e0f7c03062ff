"""Committing a written checkpoint: one manifest entry from every rank's report.

Check-N-Run (NSDI'22, Sec. 4.1): a checkpoint counts only once every rank's part is
durable; until then the previous checkpoint stays the one a restart uses.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.manifest import Entry, Manifest, saved_fraction
from torchrec_cnr.commit.retention import retire
from torchrec_cnr.encoding import FormatResolver
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.selection.policy import ChainState, Decision, Policy
from torchrec_cnr.staging import StagedCheckpoint
from torchrec_cnr.storage import RankWrite, checkpoint_id, write_checkpoint
from torchrec_cnr.storage.fs import tree_bytes

__all__ = ["Pending", "commit", "count_restore", "write_and_commit"]

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """A staged checkpoint on its way to storage."""

    seq: int
    staged: StagedCheckpoint
    decision: Decision
    chain: ChainState
    """The chain before this checkpoint."""
    resolver: FormatResolver


def write_and_commit(
    pending: Pending,
    group: Collective,
    root: Path,
    policy: Policy,
    keep_last: int | None,
    interval_decision: dict[str, Any] | None,
) -> ChainState:
    """Encodes, writes, agrees and commits one checkpoint; returns the chain it ends.

    Runs on every rank's background writer, collectively over ``group``.

    Raises:
        CheckpointError: writing failed on some rank; nothing was committed.
    """
    staged = pending.staged
    ckpt_id = checkpoint_id(pending.seq, staged.step)
    path = root / ckpt_id
    if group.rank == 0 and path.exists():
        shutil.rmtree(path)  # left by an attempt that never committed
    group.barrier()
    error: BaseException | None = None
    write = None
    try:
        write = write_checkpoint(path, staged, pending.resolver, group)
    except Exception as e:  # every rank must learn of it before anyone commits
        error = e
    try:
        group.agree(error)
    except Exception as e:
        raise CheckpointError(f"writing failed: {e}") from e
    writes = [w for w in group.gather(write) if w is not None]
    size = saved_fraction([r for w in writes for r in w.shards])
    chain = policy.advance(pending.chain, pending.decision, ckpt_id, size)
    if group.rank == 0:
        manifest = commit(
            root, ckpt_id, pending.seq, staged, policy.name, chain, writes,
            pending.resolver.restores, interval_decision,
        )  # fmt: skip
        retire(root, manifest, keep_last)
    group.barrier()
    logger.info("checkpoint %s committed (%s)", ckpt_id, staged.kind)
    return chain


def commit(
    root: Path,
    ckpt_id: str,
    seq: int,
    staged: StagedCheckpoint,
    policy: str,
    chain: ChainState,
    writes: list[RankWrite],
    restores_before: int,
    interval_decision: dict[str, Any] | None,
) -> Manifest:
    """Appends the checkpoint to the root's manifest and replaces it atomically (rank 0 only).

    IMPORTANT: call this only after every rank reported its files durable; the
    manifest's rename is what makes the checkpoint exist.

    Args:
        staged: rank 0's staged checkpoint (step, kind, dense state for the signature).
        chain: the chain state this checkpoint ends.
        writes: every rank's report, in rank order.

    Returns:
        The manifest as committed.
    """
    shards = [rec for w in writes for rec in w.shards]
    tables, dense_info = Entry.signature([s.spec for s in shards], staged.dense)
    entry = Entry(
        id=ckpt_id,
        seq=seq,
        step=staged.step,
        kind=staged.kind,
        policy=policy,
        chain=list(chain.chain),
        sizes=list(chain.sizes),
        world_size=len(writes),
        tables=tables,
        dense=dense_info,
        shards=shards,
        dense_checksums=writes[0].dense_checksums,
        app_checksums=[w.app_checksum for w in writes],
        bytes=tree_bytes(root / ckpt_id),
        restores_before=restores_before,
        staged_bytes=writes[0].staged_bytes,
        stall_s=max(w.stall_s for w in writes),
        interval_decision=interval_decision,
    )
    manifest = Manifest.load(root)
    manifest.checkpoints.append(entry)
    manifest.save(root)
    return manifest


def count_restore(root: Path) -> int:
    """Adds one to the root's restore count (rank 0 only); returns the new count."""
    manifest = Manifest.load(root)
    manifest.restores += 1
    manifest.save(root)
    return manifest.restores
