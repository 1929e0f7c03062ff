"""Restoring committed checkpoints into one rank's live model (:class:`ModelLoader`),
read again if retired while read (:func:`torchrec_cnr.read.retry.load_committed`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchrec_cnr.collectives import Collective
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.encoding import FP32
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.manifest import Entry, Manifest, Summary
from torchrec_cnr.read import ChainReader, Intact, load_committed, load_newest_intact
from torchrec_cnr.restore.apply import ReadOptions
from torchrec_cnr.restore.collective import LocalModel, restore_entry
from torchrec_cnr.restore.partial import RestoreScope
from torchrec_cnr.restore.signals import DeferredSignals
from torchrec_cnr.selection import ChainState, Policy
from torchrec_cnr.selection.rows import resume_chain
from torchrec_cnr.snapshot.objects import resolve_globals
from torchrec_cnr.staging import StagingPool
from torchrec_cnr.storage import Storage

__all__ = ["ModelLoader", "Restored"]

logger = logging.getLogger(__name__)


class ModelLoader:
    """Restores committed checkpoints into one rank's live model (collective).

    Args:
        group: the job's ranks.
        storage: the root.
        io: the I/O context reads run on.
        model: this rank's shards, dense tensors and ``app_state``.
        config: ``verify_checksums``, ``restore_memory_mb`` (host memory a restore may
            hold; ``None``: ``io.read_memory_mb``, then ``staging_memory_mb``, and if those
            are ``None`` too, all) and
            ``safe_globals`` (types ``app_state`` may hold beyond the built-in ones).
        policy: the job's policy, to continue a restored chain (see :func:`resume_chain`).
        pool: the staging buffers; a restore reads this rank's baseline into them if
            they are unbounded, a full checkpoint's (see
            :func:`~torchrec_cnr.restore.apply.read_chain`).

    Raises:
        ValueError: a ``safe_globals`` name that does not import.
    """

    def __init__(
        self,
        group: Collective,
        storage: Storage,
        io: IOContext,
        model: LocalModel,
        config: CheckpointConfig,
        policy: Policy,
        pool: StagingPool,
    ) -> None:
        self.group, self.storage, self.io, self.model = group, storage, io, model
        self.verify = config.verify_checksums
        self.options = ReadOptions(
            budget_bytes=config.io.read_budget(config.restore_memory_mb, config.staging_memory_mb),
            pool=pool if pool.budget_bytes is None else None,
            safe_globals=resolve_globals(config.safe_globals),
        )
        self.policy = policy

    def restore(
        self,
        manifest: Callable[[], Manifest],
        step: int | None,
        scope: RestoreScope,
        fall_back: bool = False,
        signals: DeferredSignals | None = None,
    ) -> Intact[Restored] | None:
        """Restores the committed checkpoint of ``step`` (the latest if ``None``); partly,
        CPR's partial recovery, with a partial ``scope`` (see :func:`restore_entry`).
        ``fall_back``: where ``step`` is ``None`` and the latest is damaged, the newest
        intact one before it (see :func:`~torchrec_cnr.read.load_newest_intact`).
        ``signals``: held from the model's first change on.

        Returns:
            What was restored; ``None`` if ``step`` is ``None`` and the root holds none.
        """

        def load(current: Manifest, entry: Summary) -> Restored:
            reader = self.group.agree_on(
                lambda: ChainReader(self.storage, current, entry, self.io, self.verify)
            )
            touched = restore_entry(self.group, reader, self.model, scope, self.options, signals)
            chain: ChainState | None = None
            if not scope.partial:
                # A partial restore keeps the live chain: the reloaded rows hold checkpointed
                # values and their bits stay set, so the next checkpoint saves them.
                state = ChainState(current.chain(entry), list(entry.sizes))
                mine = self.group.agree_on(
                    lambda: any(rec.format != FP32 for rec in reader.link_records(-1))
                )
                requantized = self.group.any(mine)
                chain = resume_chain(
                    self.model.shards, self.policy, entry.policy, state, touched, requantized
                )
            return Restored(reader.entry, current.next_seq(), touched, chain)

        if fall_back and step is None:
            return load_newest_intact(manifest, load, self.storage.url)
        loaded = load_committed(manifest, step, load, self.storage.url)
        return None if loaded is None else Intact(loaded[0], loaded[1], [], [], None)


@dataclass(frozen=True)
class Restored:
    """What :meth:`ModelLoader.restore` restored."""

    entry: Entry
    next_seq: int
    """The manifest's next checkpoint number, as read."""
    touched: list[torch.Tensor]
    """For each local shard, a ``(rows,)`` bool mask of rows that came from a delta."""
    chain: ChainState | None
    """The chain the next save continues; ``None`` after a partial restore (the live one
    goes on)."""
