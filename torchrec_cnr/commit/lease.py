"""One writer per root: a lease whose generation increases with every claim.

When torchrun's agent is SIGKILLed its workers live on and keep saving; a restarted job,
or a second job started on the same path by mistake, would then write into the same root
and each side's retention would delete the other's checkpoints. Fencing prevents it:

- A job that builds a :class:`~torchrec_cnr.CheckpointManager` claims the root: rank 0
  writes ``lease.json`` with the next generation (a conditional write, so two claimers
  cannot both win), then records that generation in the manifest. Checkpoint directories
  carry their writer's generation, so two writers never share one.
- A commit rewrites the manifest conditionally on the version it read, and only if the
  manifest still names the committer's generation: a commit from an older generation is
  refused, and an older generation never deletes anything (it deletes only after it
  committed).
- A claim succeeds over a lease that was released, has not been refreshed for
  the lease TTL, belongs to the same torchrun job (a restart), to this very
  process, or to a dead process on this host; or with ``CheckpointConfig(take_over=True)``.
  Otherwise the root is held by a live job: the claim fails naming it (a job that only
  restores claims nothing: ``read_only``). The holder refreshes its lease every quarter of
  the TTL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from torchrec_cnr import shutdown
from torchrec_cnr.errors import ManifestError
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.schema import LEASE_NAME, LeaseHolder
from torchrec_cnr.storage import PreconditionFailed, Storage

__all__ = [
    "LeaseHolder",
    "Lease",
    "blocks",
    "holder_gone",
    "live_holder",
    "read_lease",
    "this_process",
]

logger = logging.getLogger(__name__)


_STARTED = time.time()


def this_process(generation: int) -> LeaseHolder:
    """This process as the holder of ``generation``, heard from now."""
    return LeaseHolder(
        generation,
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        socket.gethostname(),
        os.getpid(),
        _STARTED,
        time.time(),
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_gone(holder: LeaseHolder, ttl_s: float) -> bool:
    """Whether ``holder`` no longer counts: released, silent past ``ttl_s``, or dead here."""
    if holder.released or time.time() - holder.heartbeat_at > ttl_s:
        return True
    return holder.host == socket.gethostname() and not _pid_alive(holder.pid)


def blocks(holder: LeaseHolder | None, ttl_s: float) -> bool:
    """Whether ``holder`` is a live job that refuses this job's claim (see :class:`Lease`):
    not released, heard from within ``ttl_s``, alive where it runs here, and neither this
    process nor an earlier attempt of this torchrun job."""
    if holder is None or holder_gone(holder, ttl_s):
        return False
    me = this_process(0)
    if holder.run_id and holder.run_id == me.run_id:
        return False
    return (holder.host, holder.pid) != (me.host, me.pid)


def live_holder(storage: Storage, ttl_s: float) -> LeaseHolder | None:
    """The live job holding ``storage`` that would refuse this job's claim, if any."""
    holder = read_lease(storage)[0]
    return holder if blocks(holder, ttl_s) else None


def read_lease(storage: Storage) -> tuple[LeaseHolder | None, str | None]:
    """Whoever holds (or held) the root, from its lease, and the lease's version; the
    holder is ``None`` without a lease or with an unreadable one (whoever wrote that can
    claim nothing by it)."""
    got = storage.read(LEASE_NAME)
    if got is None:
        return None, None
    try:
        return LeaseHolder.from_bytes(got[0]), got[1]
    except (ValueError, TypeError):
        return None, got[1]


class Lease:
    """Rank 0's claim on a root.

    Args:
        storage: the root.
        take_over: claim even from a live holder (its later commits are then refused).
        fallback: passed to :meth:`Manifest.load` when the claim records its generation.
        ttl_s: seconds after its last refresh that a lease stops counting; the holder
            refreshes it every quarter of this.
    """

    def __init__(self, storage: Storage, take_over: bool, fallback: bool, ttl_s: float) -> None:
        self.storage = storage
        self.take_over = take_over
        self.fallback = fallback
        self.ttl_s = ttl_s
        self.mine: LeaseHolder | None = None
        self._version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> LeaseHolder | None:
        """Claims the root with the next generation; returns the live holder that blocks it, if any."""
        for _ in range(10):
            holder, version = read_lease(self.storage)
            if not self.take_over and blocks(holder, self.ttl_s):
                return holder
            mine = this_process((holder.generation if holder else 0) + 1)
            try:
                self._version = self.storage.write(LEASE_NAME, mine.to_bytes(), expect=version)
            except PreconditionFailed:
                continue  # another job claimed at the same moment: look again
            self.mine = mine
            self._fence()
            self._start_heartbeat()
            return None
        raise RuntimeError(f"could not claim {self.storage.url}: the lease keeps changing")

    def claim(self) -> str | None:
        """Creates the root and claims it; says why not if a live job holds it, or if the
        root cannot be written (no space left, a read-only file system, a path under a
        file, a bucket that refuses writes)."""
        try:
            self.storage.create()
            blocker = self.acquire()
        except (PreconditionFailed, ManifestError):
            raise  # a damaged manifest is named as what it is (the caller releases the lease)
        except Exception as e:
            self._abandon()
            return f"{self.storage.url} cannot be written ({type(e).__name__}: {e}), so this job cannot claim it for its checkpoints"
        if blocker is None:
            return None
        return (
            f"{self.storage.url} is held by another live job, {blocker.describe()}: stop "
            "it, or take the root over deliberately with CheckpointConfig(take_over=True) "
            "(cnr compact --take-over); that job's later commits are then refused"
        )

    def _fence(self) -> None:
        # From now on only this generation's commits match the manifest.
        assert self.mine is not None
        for _ in range(10):
            manifest = Manifest.load(self.storage, fallback=self.fallback)
            manifest.writer_generation = self.mine.generation
            try:
                manifest.save(self.storage)
                return
            except PreconditionFailed:
                continue  # a stale writer committed meanwhile: fence its result too
        raise RuntimeError(f"could not record the writer generation in {self.storage.url}")

    def _start_heartbeat(self) -> None:
        period = self.ttl_s / 4
        self._stop.clear()  # a claim after an abandoned one beats again

        def beat() -> None:
            while not self._stop.wait(period):
                try:
                    if not self.refresh():
                        return  # another job holds the root: its commits fence ours
                except Exception as e:  # the store is unreachable for now: try again later
                    logger.warning("cannot refresh the lease of %s: %s", self.storage.url, e)

        self._thread = threading.Thread(target=beat, name="cnr-lease", daemon=True)
        self._thread.start()
        shutdown.register(self)

    def stop_thread(self) -> None:
        """Stops the heartbeat (see :mod:`torchrec_cnr.shutdown`); the lease then expires
        after its TTL unless :meth:`release` gives it up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        shutdown.unregister(self)

    def refresh(self) -> bool:
        """Renews the lease; ``False`` once another job has claimed the root."""
        if self.mine is None:
            return False
        self.mine.heartbeat_at = time.time()
        try:
            self._version = self.storage.write(
                LEASE_NAME, self.mine.to_bytes(), expect=self._version
            )
        except PreconditionFailed:
            return False
        return True

    def holder(self) -> LeaseHolder | None:
        """Whoever holds the root now."""
        return read_lease(self.storage)[0]

    def _abandon(self) -> None:
        """After a failed claim: stops the heartbeat and forgets the claim (its lease, if
        it was written, expires after the TTL)."""
        self.stop_thread()
        self.mine = None

    def release(self) -> None:
        """Gives the root up, so that the next job claims it at once."""
        self.stop_thread()
        if self.mine is None:
            return
        self.mine.released = True
        try:
            self.storage.write(LEASE_NAME, self.mine.to_bytes(), expect=self._version)
        except PreconditionFailed:
            pass  # another job holds it already
        self.mine = None
