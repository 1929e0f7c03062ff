"""A follower: keeps a serving model at the latest committed checkpoint of a root.

Check-N-Run names "publishing snapshots in real time" among the reasons to checkpoint:
serving wants fresh embeddings. Each update of a :class:`Follower`

1. reads the root's manifest (only committed checkpoints exist there), unless its stamp (a
   stat on a file system, a HEAD request on S3) shows it unchanged since the last poll,
   and picks the commit to serve: the latest, or the one after the served one while at
   most :data:`STEP_THROUGH` came after it (every commit served, in order);
2. plans which rows changed since the served checkpoint (:mod:`.plan`);
3. reads only those rows' latest versions from the target's chain, newest link first,
   each row once, with ranged reads of consecutive rows (a ranged GET on S3): where each
   row is read from is :mod:`.locate`, the whole update read and ready :mod:`.fetch`;
4. shows it to the accept gate (:mod:`.gate`);
5. applies it (:mod:`.apply`), with the dense state if it changed, to the serving model under the
   exclusive side of a lock whose shared side serving code takes around its forwards
   (:meth:`Follower.serving`), and names the new step as served under the same hold: a
   lookup sees one committed step, the one :attr:`Follower.step` names, never a mix.

Everything that can fail (a file retired by ``keep_last`` or replaced by compaction
while read, a damaged or missing file, a model that does not match) fails before the
model changes: the follower keeps serving the last good step and tries again at the next
poll, re-planning from the manifest as it is then.

Operating it: :meth:`Follower.pin` stops advancing (at the served step, or at another
committed one), :meth:`Follower.rollback` goes back to an earlier committed step reading
only the rows changed in between, and an accept gate sees each update, read and ready,
before it is served (:func:`finite_rows` by default: no NaN or infinity). A refused update
leaves the last accepted step served; the checkpoint it came from is not read again, and
the next commit's update carries its rows again.

The :class:`Follower` only sequences these parts; :mod:`.poller` is its polling thread,
and :mod:`.counters` what it reports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from typing import Any

from torchrec_cnr import shutdown
from torchrec_cnr.errors import CheckpointReadError, CnrError
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.manifest import Manifest, Summary
from torchrec_cnr.read import load_committed
from torchrec_cnr.schema import MANIFEST_NAME
from torchrec_cnr.serving.apply import Applier
from torchrec_cnr.serving.counters import Counters, UpdateReport
from torchrec_cnr.serving.fetch import UpdateReader
from torchrec_cnr.serving.gate import PendingUpdate, RefusedUpdate
from torchrec_cnr.serving.options import FollowerOptions, swap_mode
from torchrec_cnr.serving.poller import Poller
from torchrec_cnr.serving.targets import ServingTarget
from torchrec_cnr.storage import CountingStorage, Root, as_storage

__all__ = ["Follower"]

logger = logging.getLogger(__name__)

STEP_THROUGH = 2
"""A follower at most this many commits behind the root's latest serves each in turn, in
commit order: every commit is served, each commit's rows as soon as that commit can be
(a commit that landed during a cold start or a slow update, say). The price is lag: a
commit so served was committed less than about two commit intervals before the poll that
found it, against one for the latest. Further behind, serving each in turn would serve
staler steps for longer: it goes straight to the latest."""


_MOVED = ("io", "accept", "swap", "memory_budget", "spill_dir")
"""The keyword arguments a :class:`Follower` took before :class:`FollowerOptions`."""


def _moved_options(options: Any, moved: dict[str, Any]) -> Any:
    """``options``, or the :class:`FollowerOptions` the deprecated spellings make."""
    unknown = sorted(set(moved) - set(_MOVED))
    if unknown:
        raise TypeError(f"Follower() got unexpected keyword argument(s) {', '.join(unknown)}")
    if isinstance(options, IOOptions):  # the third argument was io
        moved, options = {"io": options, **moved}, None
    if not moved:
        return FollowerOptions() if options is None else options
    if options is not None:
        raise TypeError(f"Follower() takes options or {', '.join(moved)}, not both")
    warnings.warn(
        f"Follower({', '.join(f'{k}=' for k in moved)}...) is deprecated and will be removed "
        "in the next release: pass Follower(root, target, FollowerOptions(...)) (the memory "
        "budget as memory_budget_mb, in MB)",
        DeprecationWarning,
        stacklevel=3,
    )
    budget = moved.pop("memory_budget", None)
    if budget is not None:
        moved["memory_budget_mb"] = budget / 2**20
    return FollowerOptions(**moved)


def _moved_attribute(old: str, new: str) -> None:
    warnings.warn(
        f"Follower.{old} is deprecated and will be removed in the next release: read "
        f"Follower.{new}",
        DeprecationWarning,
        stacklevel=3,
    )


class Follower:
    """Keeps ``target`` at the latest committed checkpoint of ``root``; a few commits
    behind, it serves each in turn (:data:`STEP_THROUGH`).

    Read-only: any number of followers on any number of hosts follow one root without a
    lease, and a writer's commits see only their reads.

    Args:
        root: a path, a URL (``s3://``, or any fsspec protocol with
            ``options.storage_options``) or a ``Storage``.
        target: the serving model, wrapped (:class:`~torchrec_cnr.serving.FloatTarget`
            for the unsharded fp32 model, :class:`~torchrec_cnr.serving.QuantizedTarget`
            for TorchRec's quantized inference model).
        options: how it reads, checks and applies updates (:class:`FollowerOptions`: the
            I/O options, the accept gate, swap mode, the memory budget in MB and where
            spilled rows go); the defaults if ``None``.

        moved: the options' spellings before :class:`FollowerOptions` (``io``, ``accept``,
            ``swap``, ``memory_budget`` in bytes, ``spill_dir``; or an ``IOOptions`` as the
            third argument): deprecated, they still work, with a ``DeprecationWarning``.

    Raises:
        ValueError: ``options`` is not a :class:`FollowerOptions`, or its ``spill_dir``
            is not a folder.
        TypeError: a keyword argument that is neither.

    Example::

        follower = Follower("/ckpt/run1", QuantizedTarget(quantize_embeddings(model)))
        follower.poll()                       # the latest committed step, now
        follower.start(interval_s=5.0)        # and every 5 s, on a thread
        with follower.serving():              # forwards see one committed step
            scores = model(batch)
        follower.stop()

        # swap mode, reading with 4 threads:
        Follower(root, target, FollowerOptions(io=IOOptions(threads=4), swap=True))
    """

    def __init__(
        self,
        root: Root,
        target: ServingTarget,
        options: FollowerOptions | None = None,
        **moved: Any,
    ) -> None:
        options = _moved_options(options, moved)
        if not isinstance(options, FollowerOptions):
            raise ValueError(f"options must be a FollowerOptions or None, got {options!r}")
        if options.spill_dir is not None and not os.path.isdir(options.spill_dir):
            raise ValueError(f"spill_dir {options.spill_dir!r} is not a folder")
        self.options = options
        """How it reads, checks and applies updates."""
        self._io = IOContext(options.io)
        self.storage = CountingStorage(
            as_storage(root, self._io.options, options.storage_options), read_only=True
        )
        self.target = target
        swap = swap_mode(options, target.table_bytes())  # its update budget bounds copy mode
        self._reader = UpdateReader(
            self.storage,
            self._io,
            target,
            options.accept,
            None if swap else options.memory_budget_bytes,
            options.spill_dir,
        )
        self._applier = Applier(target, swap)
        self._lock = self._applier.lock
        self._poller = Poller(self.poll, self.storage.url)
        self.counters = Counters()
        """Its updates, refusals and polls."""
        self._pinned = False
        self._updating = threading.Lock()  # one update at a time: polls, pins, rollbacks
        self._seen: str | None = None  # the manifest's stamp when last planned from
        self._behind = False  # the last update served a commit older than the latest
        self._spare_deferred = False  # swap mode's copy waited for a poll (_make_spare)

    @property
    def accept(self) -> Any:
        """Deprecated: ``options.accept``."""
        _moved_attribute("accept", "options.accept")
        return self.options.accept

    @property
    def memory_budget(self) -> int | None:
        """Deprecated: ``options.memory_budget_bytes``."""
        _moved_attribute("memory_budget", "options.memory_budget_bytes")
        return self.options.memory_budget_bytes

    @property
    def spill_dir(self) -> str | None:
        """Deprecated: ``options.spill_dir``."""
        _moved_attribute("spill_dir", "options.spill_dir")
        return self.options.spill_dir

    @property
    def step(self) -> int | None:
        """The step served; ``None`` before the first update."""
        served = self._applier.served
        return None if served is None else served.step

    @property
    def swap(self) -> bool:
        """Whether it serves in swap mode (chosen when it was made, see
        :func:`~torchrec_cnr.serving.options.swap_mode`)."""
        return self._applier.swap

    @property
    def spare_bytes(self) -> int:
        """Memory the second copy of the tables takes (swap mode, once a step is served)."""
        return self._applier.spare_bytes

    @property
    def reports(self) -> list[UpdateReport]:
        """Every update applied, oldest first."""
        return self.counters.reports

    @property
    def refused(self) -> list[RefusedUpdate]:
        """Updates the accept gate refused, oldest first."""
        return self.counters.refused

    @property
    def polls(self) -> int:
        """Polls made (:meth:`poll`, on the thread or not)."""
        return self.counters.polls

    @property
    def idle_polls(self) -> int:
        """Polls that found nothing new to serve, once a step was served."""
        return self.counters.idle_polls

    @property
    def idle_requests(self) -> int:
        """Requests those polls made (one stat or HEAD each, while the manifest stays)."""
        return self.counters.idle_requests

    @property
    def failures(self) -> int:
        """Polls that failed (on the polling thread)."""
        return self._poller.failures

    @property
    def last_error(self) -> Exception | None:
        """Why the last poll failed, if it did (the last good step stays served)."""
        return self._poller.last_error

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Hold this around each forward: updates wait for it, and it waits for them."""
        return self._lock.shared()

    @property
    def pinned(self) -> bool:
        """Whether polls leave the served step as it is (:meth:`pin`)."""
        return self._pinned

    def poll(self) -> int | None:
        """Applies whatever was committed since the served checkpoint: the latest, or,
        at most :data:`STEP_THROUGH` commits behind, each of them in turn. Returns the
        step served after it (``None`` while the root holds no checkpoint). Pinned, it
        reads nothing and returns the served step.

        Raises:
            ModelMismatchError: the checkpoint's tables or dense tensors do not match the
                serving model; nothing changed.
            CheckpointReadError, ManifestError: a file is missing or damaged; nothing
                changed, and the last good step stays served.
        """
        with self._updating:
            self.counters.polls += 1
            if self._pinned:
                return self.step
            served, requests = self._applier.served, self.storage.requests
            step = self._update(None)
            for _ in range(STEP_THROUGH):  # a few commits behind: each in turn
                if not self._behind:
                    break
                step = self._update(None)
            if served is not None and self._applier.served is served:
                self.counters.count_idle(self.storage.requests - requests)
            if self._applier.spare_due:
                self._make_spare()
            return step

    def pin(self, step: int | None = None) -> int | None:
        """Stops advancing: polls keep the served step until :meth:`unpin`. Given a
        committed ``step``, serves it first (older or newer than the served one), reading
        only the rows that differ. Returns the step served.

        Raises:
            ValueError: no committed checkpoint has ``step`` (retention may have removed
                it); the served step did not change (the follower is pinned to it).
            CnrError: the accept gate refused that step; likewise.
        """
        with self._updating:
            self._pinned = True
            if step is not None and step != self.step:
                refused = len(self.refused)
                self._update(step)
                self._applier.make_spare()
                if len(self.refused) > refused:
                    raise CnrError(f"step {step} was refused: {self.refused[-1].reason}")
            return self.step

    def unpin(self) -> None:
        """Follows the root's latest step again, from the next poll."""
        self._pinned = False

    def rollback(self, step: int) -> int | None:
        """Serves the earlier committed ``step`` and stays there (pinned): a harmful
        update undone in the time of an update, not of a reload. :meth:`unpin` follows
        the latest again.

        Raises:
            ValueError: ``step`` is not older than the served step, or no committed
                checkpoint has it; nothing changed.
        """
        if self.step is None or step >= self.step:
            raise ValueError(f"rollback needs a step older than the served {self.step}, got {step}")
        return self.pin(step)

    def _update(self, step: int | None) -> int | None:
        self._behind = False
        began = time.perf_counter()
        start_bytes, start_requests = self.storage.bytes_read, self.storage.requests
        stamp = self.storage.stamp(MANIFEST_NAME)
        if step is None and stamp is not None and stamp == self._seen:
            return self.step  # nothing committed or retired since: one stat or HEAD
        # Retired by keep_last or replaced by compaction while read: planned again.
        loaded = load_committed(
            lambda: Manifest.load(self.storage),
            step,
            lambda manifest, entry: self._read(manifest, entry, asked=step is not None),
            self.storage.url,
        )
        update = None if loaded is None else loaded[1]
        if update is None:
            self._seen = stamp
            return self.step
        plan = update.plan
        assert loaded is not None
        behind = step is None and plan.target.id != loaded[0].id
        if step is not None or behind:
            stamp = None  # the next poll plans again, with or without a new commit
        if plan.rewind and step is None:
            logger.warning(
                "%s went back to step %d (it served step %d): the job restored an older "
                "checkpoint; following the root's latest",
                self.storage.url,
                plan.target.step,
                self.step,
            )
        reason = update.refused
        accept = self.options.accept
        if reason is None and accept is not None:
            reason = accept(update)
        if reason is not None:
            self._seen = stamp
            self.refused.append(RefusedUpdate(plan.target.step, plan.target.id, reason))
            logger.warning(
                "follower of %s: step %d refused (%s); serving step %s",
                self.storage.url,
                plan.target.step,
                reason,
                self.step,
            )
            return self.step
        blocked, held = self._applier.apply(update)
        self._seen, self._behind = stamp, behind
        now = time.perf_counter()
        report = UpdateReport(
            step=plan.target.step,
            checkpoint=plan.target.id,
            rows=update.count,
            bytes_read=self.storage.bytes_read - start_bytes,
            requests=self.storage.requests - start_requests,
            seconds=now - began,
            blocked_s=blocked,
            held_bytes=held,
            spilled_bytes=0 if update.spill is None else update.spill.bytes,
            lag_s=max(0.0, time.time() - plan.target.committed_at),
            cold=plan.cold,
            rewind=plan.rewind,
        )
        self.reports.append(report)
        return report.step

    def _make_spare(self) -> None:
        """Swap mode's second copy of the tables, made at the end of the poll that served
        the first step, once the follower is caught up: where a commit landed while that
        step was read, the next poll serves it first (in place, as the first step was),
        and makes the copy at its end whatever it finds. A follower that joins a running
        job serves the commits its cold start missed without waiting for the copy."""
        if self._spare_deferred or self.storage.stamp(MANIFEST_NAME) == self._seen:
            self._applier.make_spare()
        else:
            self._spare_deferred = True

    def _read(self, manifest: Manifest, latest: Summary, asked: bool) -> PendingUpdate | None:
        """The update to ``latest`` (or, following, to the commit after the served one:
        :data:`STEP_THROUGH`), read and ready; ``None`` if it is served already, or was
        refused and is not ``asked`` for by step."""
        served = self._applier.served
        if not asked:
            following = self._next(manifest, latest)
            if following is not latest:
                try:
                    return self._reader.read(manifest, following, served)
                except CheckpointReadError as e:  # retired while read, say: the latest then
                    logger.info("%s: %s; reading the latest instead", following.id, e)
            if self.counters.refused_last(latest.id):
                return None  # refused already: wait for the next commit
        return self._reader.read(manifest, latest, served)

    def _next(self, manifest: Manifest, latest: Summary) -> Summary:
        """The commit to serve next: the one after the served one where at most
        :data:`STEP_THROUGH` commits came after it and that one was not refused, the latest
        otherwise."""
        served = self._applier.served
        tail = manifest.tail
        at = next((i for i, e in enumerate(tail) if served is not None and e.id == served.id), None)
        if at is None or not 1 < len(tail) - 1 - at <= STEP_THROUGH:
            return latest
        following = tail[at + 1]
        return latest if self.counters.refused_last(following.id) else following

    # -- background ---------------------------------------------------------

    def start(self, interval_s: float = 5.0) -> None:
        """Polls every ``interval_s`` on a thread until :meth:`stop`; a failed poll is
        logged and kept in :attr:`last_error`, and the next one tries again, after twice
        the wait of the one before while polls keep failing (at most 30 s, or the
        interval if longer: :mod:`.poller`).

        Raises:
            CnrError: it is polling already.
        """
        self._poller.start(interval_s)
        shutdown.register(self)

    def stop(self) -> None:
        """Stops polling, after the update in flight."""
        self._poller.stop()
        shutdown.unregister(self)

    stop_thread = stop

    def close(self) -> None:
        """Stops polling and the read threads."""
        self.stop()
        self._io.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
