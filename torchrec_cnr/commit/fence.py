"""The fence around one job's writes to a root.

A root has one writer at a time: rank 0 holds its lease (:mod:`.lease`), and every
commit must name the writer generation that the lease recorded in the manifest, so a
job that was taken over can no longer commit. A job that cannot claim the root (another
live job holds it, or the root cannot be written) fails as it builds its fence, before its
first training step, on every rank with the same error; a job that only reads the root
(``CheckpointConfig(read_only=True)``) claims nothing. The restore counter lives here too:
only the root's writer may count a restore.

Every method is collective over the job's ranks: rank 0 does the I/O and every rank
gets its result or its error (:meth:`~torchrec_cnr.collectives.Collective.on_rank0`).
"""

from __future__ import annotations

import warnings

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.commit import CommitTarget, count_restore, drop
from torchrec_cnr.commit.lease import Lease
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.selection.policy import Policy
from torchrec_cnr.snapshot import checkpoint_id
from torchrec_cnr.storage import Storage

__all__ = ["Fence"]


class Fence:
    """This job's claim on ``storage`` for its commits.

    Args:
        storage: the root.
        group: the job's ranks.
        config: ``take_over`` (claim the root even from another live job), ``read_only``
            (claim nothing), ``manifest_fallback`` (read the previous manifest if the
            current one is damaged), ``timeouts.lease_ttl_s``, and ``keep_last`` for
            commits.
        policy: the job's policy, for commits.

    Raises:
        CheckpointError: (on every rank) the root cannot be written, or another live job
            holds it; nothing was changed.
    """

    def __init__(
        self, storage: Storage, group: Collective, config: CheckpointConfig, policy: Policy
    ) -> None:
        self.storage = storage
        self.group = group
        self.fallback = config.manifest_fallback
        self.ttl_s = config.timeouts.lease_ttl_s
        self.policy = policy
        self.keep_last = config.keep_last
        self._lease = Lease(storage, config.take_over, self.fallback, self.ttl_s)
        self.generation = 0
        """The writer generation this job's commits name."""
        self.blocked: str | None = None
        """Why this job may not write the root, if it may not (``read_only``)."""
        if config.read_only:
            self.blocked = (
                f"{storage.url} was opened with CheckpointConfig(read_only=True): this job "
                "only restores from it, and saves and compactions are refused"
            )
        try:
            if self.blocked is None:
                self._claim()
            claimed = self.manifest()
        except BaseException:
            self.release()
            raise
        self._next_seq = claimed.next_seq()
        self.restores = claimed.restores
        """Restores counted in the root (quantized checkpoints' ``bits="auto"`` reads it)."""

    def new_checkpoint(self, step: int) -> tuple[int, str]:
        """The sequence number and directory name of this job's next checkpoint."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq, checkpoint_id(seq, step, self.generation)

    def restored(self, next_seq: int) -> None:
        """A restore read a manifest whose next checkpoint number is ``next_seq``."""
        self._next_seq = max(self._next_seq, next_seq)

    def manifest(self) -> Manifest:
        """The root's manifest, read by rank 0: every rank gets its view, or its error."""
        storage, fallback = self.storage, self.fallback
        manifest = self.group.on_rank0(lambda: Manifest.load(storage, fallback=fallback))
        return manifest.attach(storage)

    def _claim(self) -> None:
        def claim() -> tuple[int, str | None]:
            blocked = self._lease.claim()
            return (self._lease.mine.generation if self._lease.mine else 0), blocked

        # Every rank gets rank 0's answer, so every rank raises the same error.
        self.generation, blocked = self.group.on_rank0(claim)
        if blocked is not None:
            raise CheckpointError(blocked)

    def check_writable(self) -> None:
        """Raises :class:`CheckpointError` if this job may not write the root."""
        if self.blocked is not None:
            raise CheckpointError(self.blocked)

    def target(self) -> CommitTarget:
        """Where, and as which generation, this job commits."""
        return CommitTarget(self.storage, self.policy, self.generation, self.keep_last)

    def count_restore(self) -> None:
        """Adds a restore to the root's count (:attr:`restores`), unless this job may not
        write the root: restores compound quantization error."""
        if self.blocked is None:
            storage, generation = self.storage, self.generation
            self.restores = self.group.on_rank0(lambda: count_restore(storage, generation))

    def retire(self, ids: list[str]) -> list[str]:
        """Retires the checkpoints ``ids`` and those that build on them (see
        :func:`~torchrec_cnr.commit.drop`); returns the ids retired."""
        self.check_writable()
        target = self.target()
        return self.group.on_rank0(lambda: drop(target, ids))

    def release(self) -> None:
        """Gives the root up (rank 0). A lease that cannot be written (a full disk) only
        warns: its TTL frees the root."""
        if self.group.rank != 0:
            return
        try:
            self._lease.release()
        except Exception as e:
            warnings.warn(
                f"could not release the lease of {self.storage.url} ({e}); it expires "
                f"{self.ttl_s:.0f} s after its last refresh",
                stacklevel=3,
            )
