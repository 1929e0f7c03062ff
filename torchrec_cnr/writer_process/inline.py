"""The background writer on the training process's own writer thread (``background="thread"``).

:class:`InlineWriter` and :class:`~torchrec_cnr.writer_process.client.WriterProcess` answer the
manager alike (:class:`Writer`): where a save's shards go, the job that encodes, writes and
commits them, the job of a compaction, and whether the writer still lives.
"""

from __future__ import annotations

from typing import Protocol

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import CommitTarget, Pending
from torchrec_cnr.commit.background import JobResult
from torchrec_cnr.commit.job import commit_job
from torchrec_cnr.compaction import (
    BackgroundCompaction,
    CompactionHook,
    compaction_job,
    finishing_job,
)
from torchrec_cnr.encoding import FormatResolver, ShardWriter
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.selection import ChainState
from torchrec_cnr.staging import RecordingSink
from torchrec_cnr.staging.shared import SharedBuffers
from torchrec_cnr.storage import Storage

__all__ = ["InlineWriter", "Writer"]


class Writer(Protocol):
    """Where a rank's background commits run."""

    @property
    def shared(self) -> SharedBuffers | None:
        """The buffers staging allocates for the writer to read (``None``: ordinary memory)."""
        ...

    @property
    def thread_nice(self) -> int | None:
        """The niceness of the training process's writer thread (``None``: the I/O options')."""
        ...

    @property
    def pid(self) -> int | None:
        """The writer process's (``None``: this process)."""
        ...

    def sink(self, ckpt_id: str, resolver: FormatResolver) -> ShardWriter | RecordingSink:
        """Where ``save()`` puts the shards of checkpoint ``ckpt_id``."""
        ...

    def commit(self, pending: Pending, target: CommitTarget, every: int | None, what: str,
               group: Collective) -> JobResult:  # fmt: skip
        """The background job of a staged checkpoint: encode, write, commit, compact every
        ``every`` deltas."""
        ...

    def compact(self, target: CommitTarget, chain: ChainState, what: str,
                group: Collective) -> JobResult:  # fmt: skip
        """The background job of a compaction."""
        ...

    def finish(self, target: CommitTarget, chain: ChainState, what: str,
               group: Collective) -> JobResult:  # fmt: skip
        """The background job at ``close()``: the compaction in flight finished."""
        ...

    def close(self) -> None: ...


class InlineWriter:
    """The writer thread's own work: shards written by a :class:`ShardWriter` as they are
    staged, the commit and compaction run right there."""

    shared = None
    thread_nice = None

    def __init__(self, storage: Storage, rank: int, io: IOContext) -> None:
        self.storage, self.rank, self.io = storage, rank, io
        self.compaction = BackgroundCompaction()

    @property
    def pid(self) -> int | None:
        return None

    def sink(self, ckpt_id: str, resolver: FormatResolver) -> ShardWriter:
        return ShardWriter(self.storage, ckpt_id, self.rank, resolver, self.io)

    def commit(self, pending: Pending, target: CommitTarget, every: int | None, what: str,
               group: Collective) -> JobResult:  # fmt: skip
        hook = CompactionHook(self.compaction, self.io, every)
        return commit_job(pending, target, what, group, hook)

    def compact(self, target: CommitTarget, chain: ChainState, what: str,
                group: Collective) -> JobResult:  # fmt: skip
        return compaction_job(target, self.io, chain, what, group, self.compaction)

    def finish(self, target: CommitTarget, chain: ChainState, what: str,
               group: Collective) -> JobResult:  # fmt: skip
        return finishing_job(target, chain, what, group, self.compaction)

    def close(self) -> None:
        self.compaction.stop()
