"""The checkpoint manager: a thin orchestrator over tracking, policy, staging,
encoding, writing, manifest and restore.

``save`` runs on the training thread only until the checkpoint is staged in
host memory. A single background thread per rank then encodes (quantizes),
writes and commits it, talking to the other ranks over a process group of its
own so that its collectives never interleave with training's.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrec_cnr import knobs, model_state
from torchrec_cnr.config import CheckpointConfig
from torchrec_cnr.encoding import FormatResolver
from torchrec_cnr.manifest import Manifest, checkpoint_id, saved_fraction, tree_bytes
from torchrec_cnr.policy import ChainState, Decision, Policy
from torchrec_cnr.recovery import choose_interval
from torchrec_cnr.restore import check_compatible, dense_signature, model_signature, restore_chain
from torchrec_cnr.staging import StagedCheckpoint, StagingPool, prioritize, stage
from torchrec_cnr.tracking import bitmap
from torchrec_cnr.tracking.tracker import LocalShard
from torchrec_cnr.writer import write_checkpoint

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A background checkpoint failed; the previous committed checkpoint stays the restore target."""


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
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.root = Path(config.path)
        self.policy = Policy(config.policy, config.baseline_rule)
        self._trackers = list(model_state.trackers(model).values())
        self._shards = model_state.local_shards(model)
        if config.priority_budget_mb is not None and any(
            t.mode == "bitmap" for t in self._trackers
        ):
            raise ValueError("priority_budget_mb needs tracking_sharders(mode='mfu' or 'ssu')")
        self._dense = model_state.dense_state(model)
        self._state = ChainState()
        self._last_saved_step: int | None = None
        self._in_flight: _InFlight | None = None
        self._auto_interval: int | None = None
        self._first_step: tuple[int, float] | None = None
        self._decision: dict[str, Any] | None = None
        """CPR's interval decision, recorded in every manifest entry once made."""
        on_gpu = any(s.weight.device.type == "cuda" for s in self._shards)
        budget = None if config.staging_memory_mb is None else config.staging_memory_mb << 20
        self._pool = StagingPool(budget, pin=on_gpu)
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.world_size))
        self._bg_pg: dist.ProcessGroup | None = dist.new_group(
            ranks, backend="gloo", timeout=timedelta(seconds=knobs.collective_timeout_s())
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-writer")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        manifest = self._load_manifest_agreed()
        self._next_seq = manifest.next_seq()
        self._restores = manifest.restores

    # -- collectives on the training thread --------------------------------

    def _barrier(self) -> None:
        dist.barrier(group=self.pg)

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(t.item())

    def _load_manifest_agreed(self) -> Manifest:
        # Rank 0's view of the manifest, so every rank picks the same ids.
        box = [Manifest.load(self.root) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        assert box[0] is not None
        return box[0]

    def _words(self) -> list[torch.Tensor]:
        """The bitmaps, once the tracker threads have caught up with training."""
        for tracker in self._trackers:
            tracker.drain()
        return [s.words for s in self._shards if s.words is not None]

    # -- save --------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Saves if ``step`` is a multiple of the interval; returns whether it did.

        With ``interval_steps="auto"`` the first checkpoint is taken at
        ``recovery.probe_step``; its measured cost sets the interval (CPR).
        """
        interval = self.config.interval_steps
        if interval == "auto":
            if self._auto_interval is None:
                return self._probe(step)
            interval = self._auto_interval
        if interval is None or step <= 0 or step == self._last_saved_step:
            return False
        assert isinstance(interval, int)
        if step % interval:
            return False
        return self.save(step)

    def _probe(self, step: int) -> bool:
        rc = self.config.recovery
        now = time.perf_counter()
        if self._first_step is None:
            self._first_step = (step, now)
        if step != rc.probe_step:
            return False
        first_step, first_time = self._first_step
        step_s = (now - first_time) / max(step - first_step, 1)
        began = time.perf_counter()
        self.save(step)
        stall = time.perf_counter() - began
        self.wait()
        commit = time.perf_counter() - began
        costs = torch.tensor([step_s, stall, commit], dtype=torch.float64)
        dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=self.pg)
        step_s, stall, commit = costs.tolist()
        decision = choose_interval(
            mtbf_s=rc.mtbf_s,
            num_shards=self.world_size,
            pls_target=rc.pls_target,
            save_cost_s=max(stall, 1e-6),
            load_cost_s=commit if rc.load_cost_s is None else rc.load_cost_s,
            reschedule_s=rc.reschedule_s,
        )
        self._auto_interval = max(1, round(decision.interval_s / step_s))
        self._decision = decision.to_json() | {
            "step_s": step_s,
            "interval_steps": self._auto_interval,
        }
        logger.warning(
            "interval auto: %s recovery, every %d steps (%.0f s); overhead partial %.4f%% vs full %.4f%%; "
            "save stall %.3f s, step %.4f s, MTBF %.0f s, %d shards, PLS %.4f",
            decision.mode,
            self._auto_interval,
            decision.interval_s,
            100 * decision.partial_overhead,
            100 * decision.full_overhead,
            stall,
            step_s,
            rc.mtbf_s,
            self.world_size,
            decision.pls,
        )
        return True

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
        busy = self._in_flight is not None and not self._in_flight.future.done()
        if self._any(busy) and self.config.on_busy == "skip":
            warnings.warn(
                f"checkpoint of step {step} skipped: step {self._in_flight.step if self._in_flight else '?'} "
                "is still being written (on_busy='skip'); its rows go into the next checkpoint",
                stacklevel=2,
            )
            return False
        self._settle()
        decision = self.policy.decide(self._state)
        for kernel in {id(s.kernel): s.kernel for s in self._shards}.values():
            kernel.flush()  # caching kernels write their cache back first
        self._words()  # every lookup so far must be in the bits being staged
        selected = None
        if self.config.priority_budget_mb is not None and decision.kind == "delta":
            selected = prioritize(self._shards, int(self.config.priority_budget_mb * (1 << 20)))
        staged = stage(
            step, decision.kind, self._shards, self._dense, self.app_state, self._pool, selected
        )
        # Bits restart at staging time; rows modified while the write runs
        # belong to the next checkpoint. On failure the staged bits go back.
        pending = [w.clone() for w in self._words()] if decision.clear_bits else []
        if decision.clear_bits and selected is not None:
            # A prioritized delta clears only what it saved; the rest waits for the next one.
            for shard, rows in zip(self._shards, selected):
                assert shard.words is not None and shard.priority is not None
                bitmap.clear_bits(shard.words, rows)
                if shard.priority.dtype == torch.int64:
                    bitmap.clear_bits(shard.priority, rows)
                else:
                    shard.priority[rows] = 0
        elif decision.clear_bits:
            for w in self._words():
                w.zero_()
            for shard in self._shards:
                if shard.priority is not None:
                    shard.priority.zero_()  # MFU counts and SSU samples restart with the bits
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        resolver = FormatResolver(self.config.quantize, self._restores)
        future = self._executor.submit(
            self._write_and_commit, seq, decision, staged, self._state, resolver
        )
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
            for w, p in zip(self._words(), job.pending_bits):
                w |= p
            raise CheckpointError(
                f"checkpoint of step {job.step} failed: {e}; the previous checkpoint stays the restore "
                "target and its rows will be saved by the next checkpoint"
            ) from e

    def _write_and_commit(
        self,
        seq: int,
        decision: Decision,
        staged: StagedCheckpoint,
        state: ChainState,
        resolver: FormatResolver,
    ) -> ChainState:
        """Background thread: encode, write, agree, commit. Collective over the writer group."""
        pg = self._bg_pg
        assert pg is not None, "save after close"
        ckpt_id = checkpoint_id(seq, staged.step)
        path = self.root / ckpt_id
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # left by an attempt that never committed
        dist.barrier(group=pg)
        error: BaseException | None = None
        result = None
        try:
            result = write_checkpoint(path, staged, resolver, pg)
        except Exception as e:  # every rank must learn of it before anyone commits
            error = e
        gathered: list[Any] = [None] * self.world_size
        report = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(gathered, (report, result), group=pg)
        failed = {r: err for r, (err, _) in enumerate(gathered) if err is not None}
        if failed:
            raise CheckpointError(f"writing failed on rank(s) {failed}") from error
        writes = [w for _, w in gathered]
        shards = [rec for w in writes for rec in w.shards]
        size = saved_fraction(shards)
        new_state = self.policy.advance(state, decision, ckpt_id, size)
        if self.rank == 0:
            tables: dict[str, dict[str, int]] = {}
            for r in shards:
                tables[r["spec"]["table"]] = {
                    "num_embeddings": r["spec"]["num_embeddings"],
                    "embedding_dim": r["spec"]["embedding_dim"],
                }
            manifest = Manifest.load(self.root)
            entry = Manifest.entry(
                seq=seq,
                step=staged.step,
                kind=decision.kind,
                policy=self.policy.name,
                chain=new_state.chain,
                sizes=new_state.sizes,
                world_size=self.world_size,
                tables=tables,
                dense=dense_signature(staged.dense),
                shards=shards,
                dense_checksums=writes[0].dense_checksums,
                app_checksums=[w.app_checksum for w in writes],
                nbytes=tree_bytes(path),
                extra={
                    "restores_before": resolver.restores,
                    "staged_bytes": staged.nbytes,
                    "interval_decision": self._decision,
                },
            )
            manifest.checkpoints.append(entry)
            # IMPORTANT: the manifest names the checkpoint only after every
            # rank reported its files durable (the gather above).
            manifest.save(self.root)
            self._collect_garbage(manifest)
        dist.barrier(group=pg)
        logger.info(
            "checkpoint %s committed (%s, %.1f%% of rows)", ckpt_id, decision.kind, 100 * size
        )
        return new_state

    def _collect_garbage(self, manifest: Manifest) -> None:
        if self.config.keep_last is None:
            return
        needed = manifest.needed_ids(self.config.keep_last)
        dropped = [e["id"] for e in manifest.checkpoints if e["id"] not in needed]
        if not dropped:
            return
        manifest.checkpoints = [e for e in manifest.checkpoints if e["id"] in needed]
        manifest.save(self.root)  # forget before deleting: never a manifest naming missing files
        for ckpt_id in dropped:
            shutil.rmtree(self.root / ckpt_id, ignore_errors=True)

    def close(self) -> None:
        """Waits for the pending checkpoint, stops the background thread and frees its group."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            # Tear the writer's gloo group down here, while its peers are alive, rather
            # than at interpreter exit, where gloo can abort on sockets already closed.
            if self._bg_pg is not None:
                dist.destroy_process_group(self._bg_pg)
                self._bg_pg = None

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
        manifest = self._load_manifest_agreed()
        entry = manifest.find(step)
        if entry is None:
            if step is None:
                return None
            raise ValueError(
                f"no committed checkpoint of step {step} in {self.root}; committed steps: {manifest.steps()}"
            )
        signature: dict[str, dict[str, int]] = {}
        for sig in self._gather(model_signature(self._shards)):
            signature.update(sig)
        check_compatible(entry, signature, dense_signature(self._dense), str(self.root))
        partial = ranks is not None or tables is not None
        chosen = self._select_shards(ranks, tables, signature)
        error: BaseException | None = None
        try:
            touched = restore_chain(
                self.root,
                manifest,
                entry,
                chosen,
                {} if partial else self._dense,
                {} if partial else self.app_state,
                self.rank,
                verify=self.config.verify_checksums,
                scalars=not partial,
            )
        except Exception as e:  # every rank must leave restore together
            error = e
        failures = [
            (r, f)
            for r, f in enumerate(
                self._gather(None if error is None else (type(error), str(error)))
            )
            if f
        ]
        if failures:
            if error is not None:
                raise error
            rank, (kind, message) = failures[0]
            # Same exception type on every rank, naming where it happened.
            raise (kind if issubclass(kind, Exception) else RuntimeError)(
                f"on rank {rank}: {message}"
            )
        if partial:
            # The live chain goes on: the reloaded rows now hold checkpointed
            # values, and their bits stay set, so the next checkpoint saves them.
            self._count_restore(manifest)
            return int(entry["step"])
        for w in self._words():
            w.zero_()
        if entry["policy"] == self.policy.name:
            self._state = ChainState(list(entry["chain"]), list(entry["sizes"]))
            if self.policy.name in ("one_shot", "intermittent"):
                # The next delta must hold every row changed since the baseline,
                # including those this restore took from the chain's deltas.
                for shard, mask in zip(self._shards, touched):
                    if shard.words is not None:
                        bitmap.set_bits(shard.words, mask.nonzero().flatten())
        else:
            self._state = ChainState()  # another policy wrote it: start a new baseline
        self._count_restore(manifest)
        self._next_seq = manifest.next_seq()
        self._last_saved_step = entry["step"]
        return int(entry["step"])

    def _select_shards(
        self,
        ranks: list[int] | None,
        tables: list[str] | None,
        signature: dict[str, dict[str, int]],
    ) -> list[LocalShard]:
        if ranks is not None:
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"ranks {bad} are outside 0..{self.world_size - 1}")
            if self.rank not in ranks:
                return []
        if tables is None:
            return list(self._shards)
        short = {name.rsplit(".", 1)[-1]: name for name in signature}
        unknown = [t for t in tables if t not in signature and t not in short]
        if unknown:
            raise ValueError(f"tables {unknown} are not in the model; tables: {sorted(signature)}")
        wanted = {short.get(t, t) for t in tables}
        return [s for s in self._shards if s.spec.table in wanted]

    def _count_restore(self, manifest: Manifest) -> None:
        # Restores compound quantization error: bits="auto" reads this count.
        self._barrier()
        self._restores = manifest.restores + 1
        if self.rank == 0:
            manifest.restores = self._restores
            manifest.save(self.root)
        self._barrier()
