"""The background writer: one thread per rank that encodes, writes and commits.

It talks to the other ranks over a gloo group of its own, so that its collectives never
interleave with training's. One job runs at a time; the manager waits for it (or skips
a save) before it stages the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from torchrec_cnr.collectives import Collective
from torchrec_cnr.errors import CheckpointError, wrapping
from torchrec_cnr.iocontext import lowered_priority
from torchrec_cnr.selection import ChainState
from torchrec_cnr.selection.rows import ClearedBits, put_back_bits
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["BackgroundWriter", "JobResult"]


@dataclass(frozen=True)
class JobResult:
    """What a background job leaves behind."""

    chain: ChainState
    """The chain after the job (the one before it, if it committed nothing new)."""
    what: str = ""
    """The job, for messages."""
    followup_error: Exception | None = None
    """A follow-up (a compaction) that failed after the job's own checkpoint was committed."""


@dataclass
class _Job:
    what: str
    """``checkpoint of step N`` or ``compaction of step N``, for messages."""
    future: Future[JobResult]
    cleared_bits: ClearedBits
    """Bits cleared when this checkpoint was staged; OR-ed back if it fails."""


class BackgroundWriter:
    """Runs one job at a time on a thread, with a process group of its own.

    Args:
        pg: the model's process group (the default group if ``None``), whose ranks its
            own group spans.
        timeout_s: how long its collectives wait for a rank.
        nice: how much lower than training's its thread's priority is (0 to 19).
    """

    def __init__(self, pg: dist.ProcessGroup | None, timeout_s: float, nice: int = 0) -> None:
        ranks = dist.get_process_group_ranks(pg) if pg is not None else None
        self._chain = ChainState()
        self.group: Collective | None = Collective(
            dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        )
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cnr-writer", initializer=lowered_priority(nice)
        )
        # Its thread starts now, not inside the first save's stall (milliseconds).
        self._executor.submit(lambda: None).result()
        self._job: _Job | None = None

    @property
    def chain(self) -> ChainState:
        """The chain after the last committed checkpoint (or the one a restore set)."""
        return self._chain

    def restart_chain(self, chain: ChainState | None = None) -> None:
        """The next checkpoint continues ``chain`` (a restored checkpoint's); without one,
        it starts a new baseline."""
        self._chain = ChainState() if chain is None else chain

    @property
    def busy(self) -> str | None:
        """What is still running on this rank, if anything."""
        job = self._job
        return job.what if job is not None and not job.future.done() else None

    def submit(
        self,
        what: str,
        fn: Callable[[Collective], JobResult],
        cleared_bits: ClearedBits,
    ) -> Future[JobResult]:
        """Starts ``fn(group)``; call :meth:`settle` first. The job is this writer's (and
        :meth:`settle` waits for it) before it can start, so that one cut short here is
        either withdrawn or waited for (see :meth:`withdraw`)."""
        if self.group is None:
            raise CheckpointError(f"{what} after close")
        group, future = self.group, Future[JobResult]()

        def run() -> None:
            if future.set_running_or_notify_cancel():  # else withdrawn before it started
                try:
                    future.set_result(fn(group))
                except BaseException as e:
                    future.set_exception(e)

        self._job = _Job(what, future, cleared_bits)
        try:
            self._executor.submit(run)
        except BaseException:  # an interrupt, or the executor shut down
            if future.cancel():  # it will never start: not this writer's any more
                self._job = None
            raise
        return future

    def withdraw(self) -> bool:
        """After :meth:`submit` (or the save leading to it) was cut short: cancels its job
        if it has not started. Whether none runs: its bits and buffers are then the
        caller's again; if ``False``, the job runs on and :meth:`settle` waits for it."""
        job = self._job
        if job is not None and not job.future.cancel():  # running, or over
            return False
        self._job = None
        return True

    def settle(self, shards: list[LocalShard]) -> None:
        """Waits for the running job, if any, and takes the chain it left.

        An exception raised in the waiting thread itself (a ``KeyboardInterrupt``, a signal
        handler's) is raised as it is, and the job is kept: it runs on, and the next call
        waits for it again.

        Raises:
            CheckpointError: the job failed; its bits are put back into ``shards``, so the
                next checkpoint saves its rows. Or its follow-up (a compaction) failed
                after its own checkpoint was committed.
        """
        # The job stays this writer's until its outcome is taken, each step of that
        # repeatable (an OR, an assignment): an interrupt anywhere here loses nothing.
        job = self._job
        if job is None:
            return
        try:
            result = job.future.result()
        except BaseException as e:
            if not _raised_by(job.future, e):
                # The wait itself was interrupted (KeyboardInterrupt, a signal handler's
                # exception): the job runs on, and the next settle() waits for it.
                raise
            put_back_bits(shards, job.cleared_bits)
            self._job = None
            raise wrapping(
                CheckpointError(
                    f"{job.what} failed: {e}; the previous checkpoint stays the restore "
                    "target and every row modified since it will be saved by the next "
                    "checkpoint"
                ),
                e,
            ) from e
        self._chain = result.chain
        self._job = None
        if result.followup_error is not None:
            raise wrapping(
                CheckpointError(
                    f"compaction after the {result.what} failed: {result.followup_error}; "
                    "that checkpoint is committed and its chain stays as it was"
                ),
                result.followup_error,
            ) from result.followup_error

    def close(self) -> None:
        """Stops the thread and frees the group; call :meth:`settle` first."""
        self._executor.shutdown(wait=True)
        # Tear the gloo group down here, while its peers are alive, rather than at
        # interpreter exit, where gloo can abort on sockets already closed.
        if self.group is not None:
            dist.destroy_process_group(self.group.pg)
            self.group = None


def _raised_by(future: Future[JobResult], e: BaseException) -> bool:
    """Whether ``future.result()`` raised ``e`` because the job failed (or was cancelled),
    not because the wait for it was interrupted."""
    if not future.done():
        return False
    return future.cancelled() or future.exception() is e
