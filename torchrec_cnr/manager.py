"""The checkpoint manager: the sequence of the pipeline's stages, and nothing else.

``save`` runs on the training thread only until the checkpoint is staged in host
memory (tracking -> selection -> staging). A background thread per rank then encodes,
writes and commits it (encoding -> storage -> commit), talking to the other ranks over
a process group of its own so that its collectives never interleave with training's.
``restore`` applies a committed chain (restore).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrec_cnr import knobs
from torchrec_cnr.collectives import Collective
from torchrec_cnr.commit import Entry, Manifest, count_restore
from torchrec_cnr.commit.commit import Pending, write_and_commit
from torchrec_cnr.commit.lease import Lease
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.encoding import FormatResolver
from torchrec_cnr.errors import CheckpointError
from torchrec_cnr.recovery import IntervalProbe
from torchrec_cnr.restore import apply_chain, check_compatible, read_chain, select_shards
from torchrec_cnr.selection import ChainState, Policy
from torchrec_cnr.selection.rows import put_back_bits, restart_bits, resume_chain, select_rows
from torchrec_cnr.staging import StagingPool, stage
from torchrec_cnr.storage import open_storage
from torchrec_cnr.tracking import model_state

__all__ = ["CheckpointError", "CheckpointManager"]

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    step: int
    future: Future[ChainState]
    pending_bits: list[torch.Tensor]
    """Bits cleared when this checkpoint was staged; OR-ed back if it fails."""


class CheckpointManager:
    """Saves and restores differential checkpoints of a TorchRec model.

    Every rank constructs one and calls :meth:`save` / :meth:`restore` at the
    same steps; both are collective over ``pg``.

    Args:
        model: a ``DistributedModelParallel`` sharded with :func:`tracking_sharders`.
        config: what, where and when to save.
        app_state: extra objects with ``state_dict()`` / ``load_state_dict()``
            (data reader, dense optimizer, RNG holder, ...), saved per rank.
        pg: process group of the model's ranks; the default group if ``None``.

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
        self.storage = open_storage(config.path)
        self.policy = Policy(config.policy, config.baseline_rule)
        self._group = Collective(pg)
        self.rank, self.world_size = self._group.rank, self._group.world_size
        self._shards = model_state.local_shards(model)
        if config.priority_budget_mb is not None and any(s.priority is None for s in self._shards):
            raise ValueError("priority_budget_mb needs tracking_sharders(mode='mfu' or 'ssu')")
        self._dense = model_state.dense_state(model)
        self._state = ChainState()
        self._last_saved_step: int | None = None
        self._in_flight: _InFlight | None = None
        self._probe = IntervalProbe(config.recovery, self._group)
        on_gpu = any(s.weight.device.type == "cuda" for s in self._shards)
        budget = None if config.staging_memory_mb is None else config.staging_memory_mb << 20
        self._pool = StagingPool(budget, pin=on_gpu)
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.world_size))
        timeout = timedelta(seconds=knobs.collective_timeout_s())
        self._writer: Collective | None = Collective(
            dist.new_group(ranks, backend="gloo", timeout=timeout)
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-writer")
        self._lease = Lease(self.storage, config.take_over, config.manifest_fallback)
        self._generation = 0
        self._blocked: str | None = None
        self._claim()
        manifest = self._manifest()
        self._next_seq = manifest.next_seq()
        self._restores = manifest.restores

    def _manifest(self) -> Manifest:
        # Rank 0 reads it and every rank gets its view, or its error: none waits in vain.
        fallback = self.config.manifest_fallback
        return self._group.on_rank0(lambda: Manifest.load(self.storage, fallback=fallback))

    def _claim(self) -> None:
        """Claims the root for this job's writes (see ``commit.lease``)."""

        def claim() -> tuple[int, str | None]:
            self.storage.create()
            blocker = self._lease.acquire()
            if blocker is None:
                assert self._lease.mine is not None
                return self._lease.mine.generation, None
            return 0, (
                f"{self.storage.url} is held by another live job, {blocker.describe()}: stop "
                "it, or pass CheckpointConfig(take_over=True) to take the root over "
                "deliberately (that job's later commits are then refused)"
            )

        self._generation, self._blocked = self._group.on_rank0(claim)

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

        Collective: every rank calls it with the same ``step``. It returns once
        the checkpoint is in host memory; encoding, writing and the commit run
        in the background (see :meth:`wait`).

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
        if self._blocked is not None:
            self._claim()  # the other job may have gone since
            if self._blocked is not None:
                raise CheckpointError(self._blocked)
        began = time.perf_counter()
        busy = self._in_flight is not None and not self._in_flight.future.done()
        if self._group.any(busy) and self.config.on_busy == "skip":
            warnings.warn(
                f"checkpoint of step {step} skipped: step {self._in_flight.step if self._in_flight else '?'} "
                "is still being written (on_busy='skip'); its rows go into the next checkpoint",
                stacklevel=2,
            )
            return False
        self._settle()
        decision = self.policy.decide(self._state)
        budget = self.config.priority_budget_mb
        rows = select_rows(self._shards, decision, None if budget is None else int(budget * 2**20))
        staged = stage(
            step, decision.kind, self._shards, rows, self._dense, self.app_state, self._pool
        )
        # Rows modified while the write runs belong to the next checkpoint.
        pending = restart_bits(self._shards, decision, rows if budget is not None else None)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        resolver = FormatResolver(self.config.quantize, self._restores)
        staged.stall_s = time.perf_counter() - began
        assert self._writer is not None, "save after close"
        job = Pending(seq, staged, decision, self._state, resolver)
        future = self._executor.submit(
            write_and_commit, job, self._writer, self.storage, self.policy, self._generation,
            self.config.keep_last, self._probe.decision,
        )  # fmt: skip
        self._in_flight = _InFlight(step, future, pending)
        self._last_saved_step = step
        return True

    def wait(self) -> None:
        """Blocks until the pending checkpoint is committed.

        Raises:
            CheckpointError: it failed; the previous committed checkpoint stays
                the restore target and its rows go into the next checkpoint.
        """
        self._settle()

    def _settle(self) -> None:
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        try:
            self._state = job.future.result()
        except BaseException as e:
            put_back_bits(self._shards, job.pending_bits)
            raise CheckpointError(
                f"checkpoint of step {job.step} failed: {e}; the previous checkpoint stays the restore "
                "target and its rows will be saved by the next checkpoint"
            ) from e

    def close(self) -> None:
        """Waits for the pending checkpoint, stops the background thread and frees its group."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            if self.rank == 0:
                self._lease.release()
            # Tear the writer's gloo group down here, while its peers are alive, rather
            # than at interpreter exit, where gloo can abort on sockets already closed.
            if self._writer is not None:
                dist.destroy_process_group(self._writer.pg)
                self._writer = None

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
        manifest = self._manifest()
        entry = manifest.find(step)
        if entry is None:
            if step is None:
                return None
            raise ValueError(
                f"no committed checkpoint of step {step} in {self.storage.url}; committed steps: {manifest.steps()}"
            )
        tables_seen: dict[str, Any] = {}
        for part in self._group.gather(Entry.signature([s.spec for s in self._shards], {})[0]):
            tables_seen.update(part)
        _, dense = Entry.signature([], self._dense)
        check_compatible(entry, tables_seen, dense, self.storage.url)
        partial = ranks is not None or tables is not None
        chosen = select_shards(self._shards, self.rank, self.world_size, ranks, tables, tables_seen)
        error: BaseException | None = None
        budget = self.config.restore_memory_mb
        try:  # every tensor is read and verified before anything changes, on every rank
            read = read_chain(
                self.storage, manifest, entry, chosen,
                [] if partial else list(self._dense),
                None if partial or not self.app_state else self.rank,
                self.config.verify_checksums, None if budget is None else budget << 20,
            )  # fmt: skip
        except Exception as e:
            error = e
        self._group.agree(error)
        try:
            touched = apply_chain(
                read, chosen, {} if partial else self._dense, {} if partial else self.app_state,
                scalars=not partial,
            )  # fmt: skip
        except Exception as e:  # verified data that fails to apply: say what it means
            error = CheckpointError(f"restore of step {entry.step} failed while applying: {e}")
        self._group.agree(error)
        if not partial:
            # A partial restore keeps the live chain: the reloaded rows hold checkpointed
            # values and their bits stay set, so the next checkpoint saves them.
            state = ChainState(list(entry.chain), list(entry.sizes))
            self._state = resume_chain(self._shards, self.policy, entry.policy, state, touched)
            self._next_seq = max(self._next_seq, manifest.next_seq())
            self._last_saved_step = entry.step
        if self._blocked is None:
            # Restores compound quantization error: bits="auto" reads this count.
            generation = self._generation
            self._restores = self._group.on_rank0(lambda: count_restore(self.storage, generation))
        return entry.step
