"""The checkpoint manager: the sequence of the pipeline's stages, and nothing else.

``save`` stages on the training thread (``staging/stager.py``); a background thread per rank
writes and commits (``commit/``) under the root's lease (``commit/fence.py``), when
``recovery/schedule.py`` says; ``restore`` reads through ``restore/loader.py`` (and ``read/``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import nn

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import Pending
from torchrec_cnr.commit.background import BackgroundWriter
from torchrec_cnr.commit.fence import Fence
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.encoding import FormatResolver
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.interop.dcp_import import import_dcp
from torchrec_cnr.iocontext import IOContext
from torchrec_cnr.launch import warn_if_restarts_unsafe
from torchrec_cnr.read import Intact
from torchrec_cnr.recovery import SaveSchedule
from torchrec_cnr.restore import DeferredSignals, LocalModel, ModelLoader, Restored, RestoreScope
from torchrec_cnr.selection import Policy
from torchrec_cnr.selection.rows import ClearedBits
from torchrec_cnr.snapshot.objects import check_app_state, resolve_globals
from torchrec_cnr.staging import LazyStaging, Stager
from torchrec_cnr.storage import Storage
from torchrec_cnr.tracking import model_state
from torchrec_cnr.writer_process import InlineWriter, Writer, WriterProcess

__all__ = ["CheckpointError", "CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores differential checkpoints of a TorchRec model.

    Every rank builds one and calls :meth:`save` / :meth:`restore` at the same steps
    (collective over ``pg``); :meth:`close` releases its threads, buffers and lease.

    Args:
        model: a ``DistributedModelParallel`` sharded with :func:`tracking_sharders`.
        config: what, where and when to save.
        app_state: objects with ``state_dict()`` / ``load_state_dict()`` (data reader,
            dense optimizer, ...), saved per rank.
        pg: the model's process group; the default group if ``None``.
        storage: a :class:`~torchrec_cnr.storage.Storage` instead of ``config.path``.

    Example::

        ckpt = CheckpointManager(model, CheckpointConfig(path=root, interval_steps=500))
        for step in range((ckpt.restore() or 0) + 1, steps + 1):
            train_step(model, next(reader))
            ckpt.maybe_save(step)
        ckpt.close()
    """

    def __init__(
        self,
        model: nn.Module,
        config: CheckpointConfig,
        app_state: Mapping[str, Any] | None = None,
        pg: dist.ProcessGroup | None = None,
        storage: Storage | None = None,
    ) -> None:
        check_app_state(app_state or {})
        self.model, self.config, self.app_state = model, config, dict(app_state or {})
        unknown = sorted(set(config.exclude_from_loading) - set(self.app_state))
        if unknown:
            raise ValueError(
                f"exclude_from_loading names {unknown}, which app_state does not hold; its "
                f"entries are {sorted(self.app_state)}"
            )
        self.storage = storage if storage is not None else config.open_root()
        self.policy = Policy(config.policy, config.baseline_rule)
        self._group = Collective(pg)  # raises unless torch.distributed is initialized
        warn_if_restarts_unsafe()
        self.rank, self.world_size = self._group.rank, self._group.world_size
        if (
            config.path.startswith("memory://")
            and storage is None
            and (self.world_size > 1 or config.background == "process")
        ):
            raise ValueError(
                f"{config.path}: a memory:// root lives in one process, so it takes one rank "
                'and background="thread"'
            )
        # First: a root this job cannot write fails every rank here, before training.
        self._fence = Fence(self.storage, self._group, config, self.policy)
        try:
            self._build(model, config, pg, storage)
        except BaseException:
            self._release()  # whatever was built: a writer process is never left behind
            self._fence.release()
            raise

    def _build(
        self,
        model: nn.Module,
        config: CheckpointConfig,
        pg: dist.ProcessGroup | None,
        storage: Storage | None,
    ) -> None:
        self._shards = model_state.local_shards(model)
        self._dense = model_state.dense_state(model)
        self._io = IOContext(config.io)
        self._writer: Writer = InlineWriter(self.storage, self.rank, self._io)
        if config.background == "process" and not config.read_only:  # it never writes
            self._writer = WriterProcess(config, self.rank, self.world_size, storage)
        self._stager = Stager(self._shards, self._dense, config, self._writer.shared)
        loaded = {k: v for k, v in self.app_state.items() if k not in config.exclude_from_loading}
        local = LocalModel(self._shards, self._dense, loaded)
        self._loader = ModelLoader(
            self._group, self.storage, self._io, local, config, self.policy, self._stager.pool
        )
        self._schedule = SaveSchedule(config, self._group)
        nice = config.io.nice if self._writer.thread_nice is None else self._writer.thread_nice
        self._background = BackgroundWriter(pg, config.timeouts.collective_timeout_s, nice)

    @property
    def lazy_staging(self) -> LazyStaging | None:
        """The copy-on-write of the last save (``None`` if it staged every row eagerly)."""
        return self._stager.lazy

    @property
    def writer_pid(self) -> int | None:
        """The pid of this rank's writer process (``background="process"``), else ``None``."""
        return self._writer.pid

    def maybe_save(self, step: int) -> bool:
        """Saves if ``step`` is due (a multiple of ``interval_steps``, or CPR's choice with
        ``"auto"``); returns whether it did."""
        return self._schedule.maybe_save(step, self.save, self.wait)

    def save(self, step: int) -> bool:
        """Stages a checkpoint at ``step`` (collective) and returns True; it is encoded,
        written and committed in the background (:meth:`wait`; with ``wait_for_commit``,
        before this returns). False: skipped, since the previous one still writes and
        ``on_busy == "skip"``.

        An exception raised in this thread meanwhile (``KeyboardInterrupt``, a signal
        handler's) passes through; the save is withdrawn, no bit lost, unless its job had
        started, which then goes on (see :meth:`wait`).

        Raises:
            CheckpointError: the previous checkpoint failed (its rows go into the next), or
                this one did (``wait_for_commit``).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._fence.check_writable()
        if self._schedule.skips(step, self._background.busy):
            return False
        self.wait()
        chain = self._background.chain
        decision = self.policy.decide(chain)
        seq, ckpt_id = self._fence.new_checkpoint(step)
        resolver = FormatResolver(self.config.quantize, self._fence.restores)
        sink = self._writer.sink(ckpt_id, resolver)
        staged, cleared, failure = self._stager.stage(step, decision, self.app_state, sink)
        try:
            job = Pending(seq, staged, sink, decision, chain, resolver,
                          self._schedule.decision, failure)  # fmt: skip
            what = f"checkpoint of step {step}"
            every, target = self.config.compact_every, self._fence.target()
            run = partial(self._writer.commit, job, target, every, what)
            self._background.submit(what, run, cleared)
        except BaseException:  # an interrupt (KeyboardInterrupt, a signal handler's)
            if self._background.withdraw():  # no job writes it: no bit lost, nothing held
                self._stager.withdraw(sink, cleared)
            raise
        self._schedule.saved(step)
        if self.config.wait_for_commit:
            self.wait()
        return True

    def compact(self) -> bool:
        """Merges the latest checkpoint's chain into one full checkpoint, on the background
        writer like a write (collective); returns False if there is nothing to compact."""
        self._fence.check_writable()
        self.wait()
        latest = self._fence.manifest().latest()
        if latest is None or latest.depth == 1:
            return False
        what, chain = f"compaction of step {latest.step}", self._background.chain
        target = self._fence.target()
        job = partial(self._writer.compact, target, chain, what)
        self._background.submit(what, job, ClearedBits())
        return True

    def wait(self) -> None:
        """Blocks until the pending checkpoint is committed; raises ``CheckpointError`` if it
        failed (the previous one stays the restore target). An exception that interrupts
        the wait itself (``KeyboardInterrupt``, a signal handler's) is raised as it is: the
        checkpoint goes on being written, and the next ``wait()`` waits for it."""
        try:
            self._background.settle(self._shards)
        finally:
            if self._background.busy is None:  # the job is over, whatever happened to it
                self._stager.detach()  # (an interrupted wait leaves it running, guarded)

    def close(self) -> None:
        """Waits for the pending checkpoint and a background compaction in flight
        (``compact_every``: committed if it compacts the latest checkpoint, else dropped),
        then releases the background writer, the I/O threads, the staging buffers, the
        tracker's thread and the lease, even if the checkpoint failed (which it then
        raises)."""
        try:
            self.wait()
            self._finish_compaction()
        finally:
            self._release()
            self._fence.release()

    def _nothing_to_restore(self) -> None:
        where = f"no committed checkpoint in {self.storage.url}"
        if self.config.require_checkpoint:
            raise CheckpointError(f"{where} to restore (CheckpointConfig.require_checkpoint)")
        if self.rank == 0:
            logger.warning("%s: nothing restored, the model stays as it is", where)

    def _passed_over(self, found: Intact[Restored]) -> None:
        """Warns (rank 0) that a restore passed over damaged checkpoints, naming the latest
        and the one restored; retires the damaged ones if ``on_damaged="retire"``."""
        url, latest, got = self.storage.url, found.passed[0], found.entry
        if self.config.on_damaged == "retire":
            retired = self._fence.retire(found.damaged)
            after = f"retired {len(retired)} checkpoint(s): {', '.join(retired)}"
        else:
            after = f"they stay in the root: cnr retire {url} --damaged removes them"
        if self.rank == 0:
            logger.warning(
                "%s: the latest checkpoint, step %d (%s), does not restore: %s; restored "
                "step %d (%s), the newest intact one, instead (on_damaged=%r), passing over "
                "%d checkpoint(s); %s",
                url, latest.step, latest.id, found.error, got.step, got.id,
                self.config.on_damaged, len(found.passed), after,
            )  # fmt: skip

    def _finish_compaction(self) -> None:
        """The background compaction in flight (``compact_every``), finished (collective)."""
        closed = self._background.group is None
        if self.config.compact_every is None or self._fence.blocked is not None or closed:
            return
        what, chain, target = "compaction in flight", self._background.chain, self._fence.target()
        self._background.submit(what, partial(self._writer.finish, target, chain, what),
                                ClearedBits())  # fmt: skip
        self.wait()

    def _release(self) -> None:
        # Each part that was built (all of them, unless the constructor failed midway).
        for part, close in (("_background", "close"), ("_writer", "close"),
                            ("_stager", "release"), ("_io", "close")):  # fmt: skip
            if hasattr(self, part):
                getattr(getattr(self, part), close)()
        for tracker in model_state.trackers(self.model).values():
            tracker.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def restore(self, step: int | None = None, *, ranks: list[int] | None = None,
                tables: list[str] | None = None, from_dcp: str | os.PathLike[str] | None = None,
                app_keys: Mapping[str, str] | None = None) -> int | None:  # fmt: skip
        """Loads the committed checkpoint of ``step`` (``CheckpointConfig.restore_step``, or
        the latest, if ``None``) into the model, its optimizer state and ``app_state`` (but
        ``exclude_from_loading``), all or nothing (collective); returns its step, ``None``
        if the root holds none. ``ranks`` or ``tables``: CPR's partial recovery.

        ``from_dcp``: imports a PyTorch DCP checkpoint of this model instead, saved from
        any world size and sharding (see :mod:`torchrec_cnr.interop.dcp_import` for how
        its keys map; ``app_keys`` maps an ``app_state`` name to its key there); the next
        save is a baseline. Returns ``step`` (the step the DCP checkpoint stands for), 0
        if ``None``.

        Raises:
            ValueError, ModelMismatchError, CheckpointReadError, UnsafeObjectError: no
                such step, another model, a missing or damaged file, an ``app_state`` type
                not in ``safe_globals`` (see :class:`~torchrec_cnr.restore.ModelLoader`).
        """
        try:
            self.wait()
        except CheckpointError as e:
            logger.warning("restoring after a failed checkpoint: %s", e)
        scope = RestoreScope(ranks, tables)
        if from_dcp is not None:
            if scope.partial:
                raise ValueError("from_dcp imports the whole model: ranks and tables do not apply")
            try:
                import_dcp(self._group, os.fspath(from_dcp), self._shards, self._dense,
                           self.app_state, app_keys, resolve_globals(self.config.safe_globals))  # fmt: skip
            finally:  # even after a partial import, the next save is a baseline
                self._background.restart_chain()
            return step or 0
        if step is None:
            step = self.config.restore_step
        fall_back = self.config.on_damaged != "raise" and not scope.partial
        # A signal that raises waits from the model's first change until the manager has
        # taken the restored chain: it is raised here, with the restore whole.
        with DeferredSignals() as signals:
            found = self._loader.restore(self._fence.manifest, step, scope, fall_back, signals)
            if found is None:
                self._nothing_to_restore()
                return None
            restored = found.loaded
            if found.passed:
                self._passed_over(found)
            if restored.chain is not None:
                self._background.restart_chain(restored.chain)
                self._fence.restored(restored.next_seq)
                self._schedule.saved(restored.entry.step)
            self._fence.count_restore()
        return restored.entry.step
