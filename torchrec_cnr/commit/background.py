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
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.executors import lowered_priority
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
        ranks: the global ranks of the model's process group.
        timeout_s: how long its collectives wait for a rank.
        nice: how much lower than training's its thread's priority is (0 to 19).
    """

    def __init__(self, ranks: list[int], timeout_s: float, nice: int = 0) -> None:
        self.group: Collective | None = Collective(
            dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        )
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cnr-writer", initializer=lowered_priority(nice)
        )
        self._job: _Job | None = None

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
        """Starts ``fn(group)``; call :meth:`settle` first."""
        if self.group is None:
            raise CheckpointError(f"{what} after close")
        future = self._executor.submit(fn, self.group)
        self._job = _Job(what, future, cleared_bits)
        return future

    def settle(self, shards: list[LocalShard]) -> JobResult | None:
        """Waits for the running job; returns what it left (``None`` if none ran). A
        follow-up's failure is in the result, for the caller to report.

        Raises:
            CheckpointError: the job failed; its bits are put back into ``shards``, so the
                next checkpoint saves its rows.
        """
        job, self._job = self._job, None
        if job is None:
            return None
        try:
            result = job.future.result()
        except BaseException as e:
            put_back_bits(shards, job.cleared_bits)
            raise CheckpointError(
                f"{job.what} failed: {e}; the previous checkpoint stays the restore target "
                "and every row modified since it will be saved by the next checkpoint"
            ) from e
        return result

    def close(self) -> None:
        """Stops the thread and frees the group; call :meth:`settle` first."""
        self._executor.shutdown(wait=True)
        # Tear the gloo group down here, while its peers are alive, rather than at
        # interpreter exit, where gloo can abort on sockets already closed.
        if self.group is not None:
            dist.destroy_process_group(self.group.pg)
            self.group = None
