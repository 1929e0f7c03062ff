"""The checkpoint manager: the sequence of the pipeline's stages, and nothing else.

``save`` runs on the training thread only until the checkpoint is staged in host
memory (tracking -> selection -> staging). A background thread per rank then encodes,
writes and commits it (encoding -> storage -> commit), talking to the other ranks over
a process group of its own so that its collectives never interleave with training's.
``restore`` applies a committed chain (restore).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import Manifest, Pending, Target, count_restore, write_and_commit
from torchrec_cnr.commit.background import BackgroundWriter, JobResult
from torchrec_cnr.commit.lease import Lease
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.encoding import FormatResolver, ShardWriter
from torchrec_cnr.errors import CheckpointError, CheckpointReadError
from torchrec_cnr.executors import Executors
from torchrec_cnr.offline.compact import compact
from torchrec_cnr.recovery import IntervalProbe
from torchrec_cnr.restore import ChainReader, restore_entry
from torchrec_cnr.selection import ChainState, Policy
from torchrec_cnr.selection.policy import Decision
from torchrec_cnr.selection.rows import (
    ClearedBits,
    restart_bits,
    resume_chain,
    select_recent,
    select_rows,
)
from torchrec_cnr.snapshot import checkpoint_id
from torchrec_cnr.snapshot.objects import resolve_globals, serialize_app_state
from torchrec_cnr.staging import (
    LazyStaging,
    StagedCheckpoint,
    StagingPool,
    lazy_fallback,
    stage,
)
from torchrec_cnr.storage import Storage, open_storage
from torchrec_cnr.tracking import bitmap, model_state

__all__ = ["CheckpointError", "CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores differential checkpoints of a TorchRec model.

    Every rank constructs one and calls :meth:`save` / :meth:`restore` at the
    same steps; both are collective over ``pg``.

    Args:
        model: a ``DistributedModelParallel`` sharded with :func:`tracking_sharders`.
        config: what, where and when to save.
        app_state: extra objects with ``state_dict()`` / ``load_state_dict()``
            (data reader, dense optimizer, RNG holder, ...), saved per rank. A TorchRec
            ``KeyedOptimizer`` whose state is still empty is initialized (``init_state()``)
            before it loads its saved state.
        pg: process group of the model's ranks; the default group if ``None``.
        storage: a :class:`~torchrec_cnr.storage.Storage` to use instead of opening
            ``config.path`` (a backend of your own, or one wrapped for tests).

    The manager owns its threads (background writer, I/O and encoding pools, lease
    heartbeat), its staging buffers and the row tracker's worker thread: :meth:`close`
    releases them all.

    Example::

        ckpt = CheckpointManager(model, CheckpointConfig(path=root, policy="intermittent",
                                 interval_steps=500), app_state={"reader": reader})
        start = ckpt.restore() or 0
        for step in range(start + 1, steps + 1):
            train_step(model, next(reader))
            ckpt.maybe_save(step)
        ckpt.wait()
    """

    def __init__(
        self,
        model: nn.Module,
        config: CheckpointConfig,
        app_state: Mapping[str, Any] | None = None,
        pg: dist.ProcessGroup | None = None,
        storage: Storage | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "CheckpointManager needs an initialized torch.distributed process group"
            )
        for name, obj in (app_state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(f"app_state[{name!r}] needs state_dict() and load_state_dict()")
        self.model = model
        self.config = config
        self.app_state = dict(app_state or {})
        self.storage = storage if storage is not None else open_storage(config.path)
        self.policy = Policy(config.policy, config.baseline_rule)
        self._group = Collective(pg)
        self.rank, self.world_size = self._group.rank, self._group.world_size
        self._shards = model_state.local_shards(model)
        if config.priority_budget_mb is not None and any(s.priority is None for s in self._shards):
            raise ValueError("priority_budget_mb needs tracking_sharders(mode='mfu' or 'ssu')")
        self._dense = model_state.dense_state(model)
        self._safe_globals = resolve_globals(config.safe_globals)
        self._last_saved_step: int | None = None
        self._chain = ChainState()
        """The chain after the last committed checkpoint (or the restored one)."""
        self._probe = IntervalProbe(config.recovery, self._group)
        io = config.io
        self._pools = Executors(io.threads, io.encode_threads, io.object_bytes, io.nice)
        on_gpu = any(s.weight.device.type == "cuda" for s in self._shards)
        budget = None if config.staging_memory_mb is None else int(config.staging_memory_mb * 2**20)
        self._pool = StagingPool(budget, pin=on_gpu)
        # So that the first save stalls no longer than the others: the buffers of a full
        # checkpoint faulted in, and torch.save's imports (done on its first call) done.
        self._pool.prefault(self._shards, self._dense)
        serialize_app_state({})
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.world_size))
        self._background = BackgroundWriter(ranks, io.collective_timeout_s, io.nice)
        self._lease = Lease(
            self.storage, config.take_over, config.manifest_fallback, io.lease_ttl_s
        )
        self._generation = 0
        self._blocked: str | None = None
        self.lazy_staging: LazyStaging | None = None
        """The copy-on-write of the last save (``None`` if it staged every row eagerly):
        its ``hook_rows``, ``hook_s`` and ``background_s`` tell who copied what."""
        self._fallbacks_said: set[str] = set()
        try:
            self._claim()
            manifest = self._manifest()
        except BaseException:
            self._release()
            raise
        self._next_seq = manifest.next_seq()
        self._restores = manifest.restores

    def _manifest(self) -> Manifest:
        # Rank 0 reads it and every rank gets its view, or its error: none waits in vain.
        fallback = self.config.manifest_fallback
        return self._group.on_rank0(lambda: Manifest.load(self.storage, fallback=fallback))

    def _claim(self) -> None:
        """Claims the root for this job's writes (see ``commit.lease``)."""

        def claim() -> tuple[int, str | None]:
            blocked = self._lease.claim()
            return (self._lease.mine.generation if self._lease.mine else 0), blocked

        self._generation, self._blocked = self._group.on_rank0(claim)
        if self._blocked is not None:
            logger.warning("%s: saves are refused: %s", self.storage.url, self._blocked)

    # -- save --------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Saves if ``step`` is a multiple of the interval; returns whether it did.

        With ``interval_steps="auto"`` the first checkpoint is taken at
        ``recovery.probe_step``; its measured cost sets the interval (CPR).
        """
        interval = self.config.interval_steps
        if interval == "auto":
            if self._probe.interval_steps is None:
                return self._probe.maybe_probe(step, lambda: self.save(step), self.wait)
            interval = self._probe.interval_steps
        if not isinstance(interval, int) or step <= 0 or step == self._last_saved_step:
            return False
        return step % interval == 0 and self.save(step)

    def save(self, step: int) -> bool:
        """Stages a checkpoint of the model, its optimizer state and ``app_state`` at ``step``.

        Collective: every rank calls it with the same ``step``. With
        ``staging="eager"`` it returns once the checkpoint's rows are in host memory;
        with ``"lazy"`` (copy-on-write) once their bitmaps, the dense state and
        ``app_state`` are, and the rows follow before training can change them. Encoding,
        writing and the commit run in the background (see :meth:`wait`).

        Returns:
            True if a checkpoint was started; False if it was skipped because
            the previous one is still writing and ``config.on_busy == "skip"``.

        Raises:
            ValueError: ``step`` is negative or not an int.
            CheckpointError: the previous background checkpoint failed. Its
                rows are carried into the next checkpoint.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._check_writable()
        began = time.perf_counter()
        busy = self._background.busy
        # Only "skip" needs every rank's view (they must skip together); "wait" waits below.
        if self.config.on_busy == "skip" and self._group.any(busy is not None):
            what = busy or "previous checkpoint"
            warnings.warn(
                f"checkpoint of step {step} skipped: the {what} is still being written "
                "(on_busy='skip'); its rows go into the next checkpoint",
                stacklevel=2,
            )
            return False
        self._settle()
        state = self._chain
        decision = self.policy.decide(state)
        budget = self.config.priority_budget_mb
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        resolver = FormatResolver(self.config.quantize, self._restores)
        ckpt_id = checkpoint_id(seq, step, self._generation)
        sink = ShardWriter(self.storage, ckpt_id, self.rank, resolver, self._pools)
        failure: Exception | None = None
        staged: StagedCheckpoint | None = None
        cleared = ClearedBits()
        lazy = self._lazy_shards(decision)
        eager = [i for i in range(len(self._shards)) if i not in lazy]
        self.lazy_staging = None
        try:
            shards = [self._shards[i] for i in eager]
            rows = select_rows(shards, decision, None if budget is None else int(budget * 2**20))
            recent = select_recent(shards, decision, rows)
            staged = stage(
                step, decision.kind, shards, rows, self._dense, self.app_state,
                self._pool, sink, recent, [f"s{i}" for i in eager],
            )  # fmt: skip
            if lazy:
                self.lazy_staging = LazyStaging.begin(
                    [self._shards[i] for i in lazy], [f"s{i}" for i in lazy], decision, self._pool
                )
                staged.rest = self.lazy_staging.run
                staged.staged_bytes += self.lazy_staging.nbytes
            # Rows modified while the write runs belong to the next checkpoint.
            cleared = restart_bits(self._shards, decision, rows if budget is not None else None)
            staged.stall_s = time.perf_counter() - began
        except Exception as e:  # e.g. a NaN row in a chunk: every rank learns of it below
            if self.lazy_staging is not None:
                self.lazy_staging.detach()
            sink.abandon()
            failure = e
        job = Pending(seq, staged, sink, decision, state, resolver, self._probe.decision, failure)
        target, every, pools = self._target(), self.config.compact_every, self._pools
        what = f"checkpoint of step {step}"

        def write(group: Collective) -> JobResult:
            # Write and commit; then compact if the chain has grown ``every`` deltas long.
            written = write_and_commit(job, group, target)
            if every is None:
                return JobResult(written, what)
            try:
                return JobResult(compact(group, target, pools, every) or written, what)
            except Exception as e:  # the checkpoint itself is committed
                return JobResult(written, what, followup_error=e)

        self._background.submit(what, write, cleared)
        self._last_saved_step = step
        return True

    def _lazy_shards(self, decision: Decision) -> list[int]:
        """The shards this save stages lazily (copy-on-write); it logs why others are not."""
        if self.config.staging != "lazy":
            return []
        if self.config.priority_budget_mb is not None:
            self._say_eager("prioritized saves (priority_budget_mb) choose their rows at save()")
            return []
        lazy: list[int] = []
        why: dict[str, list[str]] = {}
        for i, shard in enumerate(self._shards):
            reason = lazy_fallback(shard)
            if reason is None:
                lazy.append(i)
            else:
                why.setdefault(reason, []).append(shard.spec.table)
        for reason, tables in why.items():
            self._say_eager(f"{', '.join(sorted(set(tables)))}: {reason}")
        budget = self._pool.budget_bytes
        if lazy and budget is not None:
            need = 0
            for shard in self._shards:
                shard.drain()
                words = None if decision.kind == "full" else shard.words
                rows = shard.spec.rows if words is None else bitmap.count(words)
                need += rows * shard.row_bytes(words is not None)
            if need > budget:
                self._say_eager(
                    f"this save needs {need / 2**20:.0f} MB of staging buffers, more than "
                    f"staging_memory_mb={self.config.staging_memory_mb}: staged in chunks"
                )
                return []
        return lazy

    def _say_eager(self, why: str) -> None:
        if why not in self._fallbacks_said:
            self._fallbacks_said.add(why)
            logger.info("staging eagerly (the stall grows with the checkpoint): %s", why)

    def compact(self) -> bool:
        """Merges the chain of the latest committed checkpoint into one full checkpoint.

        Collective. It runs on the background writer, like a write: training goes on,
        and the next ``save`` waits for it (or skips, with ``on_busy="skip"``). Once it
        is committed, restores of that step read one checkpoint and ``keep_last`` can
        retire the chain's older links; a quantized chain keeps its stored values.

        Returns:
            False if there is nothing to compact (no checkpoint, or a lone full one).

        Raises:
            CheckpointError: the previous background job failed, or another live job
                holds the root.
        """
        self._check_writable()
        self._settle()
        latest = self._manifest().latest()
        if latest is None or len(latest.chain) == 1:
            return False
        target, state, pools = self._target(), self._chain, self._pools
        what = f"compaction of step {latest.step}"

        def job(group: Collective) -> JobResult:
            return JobResult(compact(group, target, pools) or state, what)

        self._background.submit(what, job, ClearedBits())
        return True

    def _target(self) -> Target:
        return Target(self.storage, self.policy, self._generation, self.config.keep_last)

    def _check_writable(self) -> None:
        if self._blocked is not None:
            self._claim()  # the other job may have gone since
            if self._blocked is not None:
                raise CheckpointError(self._blocked)

    def wait(self) -> None:
        """Blocks until the pending checkpoint is committed.

        Raises:
            CheckpointError: it failed; the previous committed checkpoint stays
                the restore target and its rows go into the next checkpoint.
        """
        self._settle()

    def _settle(self) -> None:
        try:
            result = self._background.settle(self._shards)
        finally:
            if self.lazy_staging is not None:
                self.lazy_staging.detach()  # its job is over, whatever happened to it
        if result is None:
            return
        self._chain = result.chain
        if result.followup_error is not None:
            raise CheckpointError(
                f"compaction after the {result.what} failed: {result.followup_error}; that "
                "checkpoint is committed and its chain stays as it was"
            ) from result.followup_error

    def close(self) -> None:
        """Waits for the pending checkpoint, then releases everything the manager holds:
        the background writer and its group, the I/O and encoding threads, the staging
        buffers, the row tracker's thread and the root's lease.

        Raises:
            CheckpointError: the pending checkpoint failed (everything is released all
                the same). A lease that cannot be written (a full disk) only warns: its
                TTL frees the root.
        """
        try:
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        self._background.close()
        if self.lazy_staging is not None:
            self.lazy_staging.detach()
        self._pools.close()
        self._pool.release()
        for tracker in model_state.trackers(self.model).values():
            tracker.close()
        if self.rank == 0:
            try:
                self._lease.release()
            except Exception as e:
                warnings.warn(
                    f"could not release the lease of {self.storage.url} ({e}); it expires "
                    f"{self.config.io.lease_ttl_s:.0f} s after its last refresh",
                    stacklevel=3,
                )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restore -----------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        *,
        ranks: list[int] | None = None,
        tables: list[str] | None = None,
    ) -> int | None:
        """Loads a committed checkpoint into the model, its optimizer state and ``app_state``.

        With ``ranks`` or ``tables`` it is a partial recovery (CPR): only the
        named ranks' shards of the named tables reload; every other shard, the
        dense state and ``app_state`` keep their current values, and training
        goes on from the current step.

        Args:
            step: the step to restore; the latest committed checkpoint if ``None``.
            ranks: reload only the shards these ranks hold.
            tables: reload only these tables (short or qualified names).

        Returns:
            The restored step, or ``None`` if the root holds no checkpoint.

        Raises:
            ValueError: no committed checkpoint has ``step``.
            ModelMismatchError: the checkpoint belongs to another model; nothing changed.
            CheckpointReadError: a checkpoint directory of the chain is missing; nothing changed.
            ChecksumError: a stored tensor is corrupt (the message names it).
        """
        try:
            self._settle()
        except CheckpointError as e:
            logger.warning("restoring after a failed checkpoint: %s", e)
        budget = self.config.restore_memory_mb
        for attempt in range(3):
            manifest = self._manifest()
            entry = manifest.find(step)
            if entry is None:
                if step is None:
                    return None
                raise ValueError(
                    f"no committed checkpoint of step {step} in {self.storage.url}; "
                    f"committed steps: {manifest.steps()}"
                )
            try:
                chain = self._group.agree_on(
                    functools.partial(
                        ChainReader, self.storage, manifest, entry, self._pools.io,
                        self._pools.object_bytes, self.config.verify_checksums,
                    )
                )  # fmt: skip
                touched = restore_entry(
                    self._group, chain, self._shards, self._dense, self.app_state,
                    ranks=ranks, tables=tables,
                    budget_bytes=None if budget is None else budget << 20,
                    # Unbounded staging buffers are a full checkpoint's: read into them.
                    pool=self._pool if self._pool.budget_bytes is None else None,
                    safe_globals=self._safe_globals,
                )  # fmt: skip
                break
            except CheckpointReadError:
                # Nothing changed yet. Another job's keep_last may have retired the
                # checkpoint while it was read: then read what the manifest names now.
                if attempt == 2 or self._manifest().find(entry.step) == entry:
                    raise
                logger.warning("checkpoint %s was retired while read; reading again", entry.id)
        assert entry is not None
        if ranks is None and tables is None:
            # A partial restore keeps the live chain: the reloaded rows hold checkpointed
            # values and their bits stay set, so the next checkpoint saves them.
            state = ChainState(list(entry.chain), list(entry.sizes))
            self._chain = resume_chain(self._shards, self.policy, entry.policy, state, touched)
            self._next_seq = max(self._next_seq, manifest.next_seq())
            self._last_saved_step = entry.step
        if self._blocked is None:
            # Restores compound quantization error: bits="auto" reads this count.
            generation = self._generation
            self._restores = self._group.on_rank0(lambda: count_restore(self.storage, generation))
        return entry.step
