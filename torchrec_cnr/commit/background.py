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

import torch
import torch.distributed as dist

from torchrec_cnr import knobs
from torchrec_cnr.collectives import Collective
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.selection import ChainState
from torchrec_cnr.selection.rows import put_back_bits
from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["BackgroundWriter", "Outcome"]

Outcome = tuple[ChainState, Exception | None]
"""What a job returns: the chain state after it, and the error of a follow-up (a
compaction) that failed after the job's own checkpoint was committed."""


@dataclass
class _Job:
    what: str
    """``checkpoint of step N`` or ``compaction of step N``, for messages."""
    future: Future[Outcome]
    pending_bits: list[torch.Tensor]
    """Bits cleared when this checkpoint was staged; OR-ed back if it fails."""


class BackgroundWriter:
    """Runs one job at a time on a thread, with a process group of its own.

    Args:
        ranks: the global ranks of the model's process group.

    Attributes:
        state: the chain state after the last job that committed (a restore sets it).
    """

    def __init__(self, ranks: list[int]) -> None:
        self.state = ChainState()
        timeout = timedelta(seconds=knobs.collective_timeout_s())
        self.group: Collective | None = Collective(
            dist.new_group(ranks, backend="gloo", timeout=timeout)
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-writer")
        self._job: _Job | None = None

    @property
    def busy(self) -> str | None:
        """What is still running on this rank, if anything."""
        job = self._job
        return job.what if job is not None and not job.future.done() else None

    def submit(
        self, what: str, fn: Callable[[Collective], Outcome], pending_bits: list[torch.Tensor]
    ) -> None:
        """Starts ``fn(group)``; call :meth:`settle` first."""
        if self.group is None:
            raise RuntimeError(f"{what} after close")
        group = self.group
        self._job = _Job(what, self._executor.submit(fn, group), pending_bits)

    def settle(self, shards: list[LocalShard]) -> None:
        """Waits for the running job and takes the chain state it left.

        Raises:
            CheckpointError: the job failed (its bits are put back into ``shards``, so
                the next checkpoint saves its rows), or its follow-up compaction did.
        """
        job, self._job = self._job, None
        if job is None:
            return
        try:
            self.state, later = job.future.result()
        except BaseException as e:
            put_back_bits(shards, job.pending_bits)
            raise CheckpointError(
                f"{job.what} failed: {e}; the previous checkpoint stays the restore target "
                "and every row modified since it will be saved by the next checkpoint"
            ) from e
        if later is not None:
            raise CheckpointError(
                f"compaction after the {job.what} failed: {later}; that checkpoint is "
                "committed and its chain stays as it was"
            ) from later

    def close(self) -> None:
        """Stops the thread and frees the group; call :meth:`settle` first."""
        self._executor.shutdown(wait=True)
        # Tear the gloo group down here, while its peers are alive, rather than at
        # interpreter exit, where gloo can abort on sockets already closed.
        if self.group is not None:
            dist.destroy_process_group(self.group.pg)
            self.group = None
