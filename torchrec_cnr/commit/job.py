"""The save's commit job: a staged checkpoint encoded, written, agreed and committed on
every rank's background writer, with what a plug-in adds around it (:class:`CommitHook`;
compaction is one: :class:`~torchrec_cnr.compaction.background.CompactionHook`)."""

from __future__ import annotations

from typing import Protocol

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.background import JobResult
from torchrec_cnr.commit.commit import CommitTarget, Landing, Pending, write_and_commit, write_rank
from torchrec_cnr.selection import ChainState

__all__ = ["CommitHook", "commit_job"]


class CommitHook(Landing, Protocol):
    """What a plug-in does around one commit job, collectively on every rank: before the
    commit, after this rank's part is written; in it (rank 0, :class:`Landing`); after it,
    or when it failed."""

    def before_commit(self, pending: Pending, group: Collective, target: CommitTarget) -> Pending:
        """The checkpoint to commit: ``pending``, its chain perhaps changed."""
        ...

    def commit_failed(self, group: Collective, target: CommitTarget) -> None:
        """The commit failed: undo what :meth:`before_commit` began."""
        ...

    def after_commit(
        self, group: Collective, target: CommitTarget, chain: ChainState
    ) -> Exception | None:
        """The checkpoint is committed and ends ``chain``: the plug-in's own failure, if
        any, reported beside the committed checkpoint."""
        ...


def commit_job(
    pending: Pending,
    target: CommitTarget,
    what: str,
    group: Collective,
    hook: CommitHook | None = None,
) -> JobResult:
    """A background job: writes and commits ``pending`` (see
    :func:`~torchrec_cnr.commit.commit.write_and_commit`), ``hook`` around it."""
    written = write_rank(pending)  # first: the writer process reads staging's messages
    if hook is not None:
        pending = hook.before_commit(pending, group, target)
    try:
        chain = write_and_commit(pending, group, target, written, hook)
    except Exception:
        if hook is not None:
            hook.commit_failed(group, target)
        raise
    error = hook.after_commit(group, target, chain) if hook is not None else None
    return JobResult(chain, what, followup_error=error)
