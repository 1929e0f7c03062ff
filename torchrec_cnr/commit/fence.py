"""The fence around one job's writes to a root.

A root has one writer at a time: rank 0 holds its lease (:mod:`.lease`), and every
commit must name the writer generation that the lease recorded in the manifest, so a
job that was taken over can no longer commit. A job that cannot claim the root (another
live job holds it, or the root cannot be written) still restores and reads; only its
saves are refused, with the reason. The restore counter lives here too: only the
root's writer may count a restore.

Every method is collective over the job's ranks: rank 0 does the I/O and every rank
gets its result or its error (:meth:`~torchrec_cnr.collectives.Collective.on_rank0`).
"""

from __future__ import annotations

import logging
import warnings

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit.commit import CommitTarget, count_restore
from torchrec_cnr.commit.lease import Lease
from torchrec_cnr.commit.manifest import Manifest
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.selection.policy import Policy
from torchrec_cnr.snapshot import checkpoint_id
from torchrec_cnr.storage import Storage

__all__ = ["Fence"]

logger = logging.getLogger(__name__)


class Fence:
    """This job's claim on ``storage`` for its commits.

    Args:
        storage: the root.
        group: the job's ranks.
        config: ``take_over`` (claim the root even from another live job),
            ``manifest_fallback`` (read the previous manifest if the current one is
            damaged), ``timeouts.lease_ttl_s``, and ``keep_last`` for commits.
        policy: the job's policy, for commits.
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
        """Why this job may not write the root, if it may not."""
        try:
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

        self.generation, self.blocked = self.group.on_rank0(claim)
        if self.blocked is not None:
            logger.warning("%s: saves are refused: %s", self.storage.url, self.blocked)

    def check_writable(self) -> None:
        """Raises :class:`CheckpointError` if this job may not write the root; a job that
        was blocked claims again first (the other job may have gone since)."""
        if self.blocked is not None:
            self._claim()
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
